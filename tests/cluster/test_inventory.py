"""Bad inventories and unreachable nodes, through the real `dtrain train --cluster`: each gets exit
code 2 and one `error:` line naming the node (or the file and key) and what to do. Nothing here
needs root: the nodes that are reached are closed ports on loopback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from runs import cli, isolated_env

from dtrain.common.errors import ExitCode

TRAIN = ["train", "mnist", "--cluster", "lab", "--output", "gs://bucket/runs"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def node(name: str, address: str, **extra: object) -> str:
    lines = ["[[clusters.lab.nodes]]", f'name = "{name}"', f'address = "{address}"']
    for k, v in extra.items():
        lines.append(f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {str(v).lower()}")
    return "\n".join(lines) + "\n"


def run(tmp_path: Path, toml: str, *args: str, files: dict[str, str] | None = None) -> str:
    (tmp_path / "dtrain.toml").write_text(toml)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    r = cli(tmp_path, *(args or TRAIN), env=isolated_env(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "config")))
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    return line


HEAD = '[clusters.lab]\nbackend = "hosts"\n'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", "dtrain.toml [clusters.lab]: no nodes: add [[clusters.lab.nodes]] tables with a name and an address"),
        (node("n0", "10.0.0.1") + '[[clusters.lab.nodes]]\nname = "n1"\n', "node 'n1' has no address"),
        (
            node("n0", "10.0.0.1") + node("n1", "10.0.0.1"),
            "node 'n1' has the same address 10.0.0.1 as node 'n0'",
        ),
        (node("n0", "10.0.0.1") + node("n0", "10.0.0.2"), "node 'n0' is listed twice"),
        (
            node("n0", "10.0.0.1", master=True) + node("n1", "10.0.0.2", master=True),
            "more than one master (n0, n1): mark exactly one",
        ),
        (node("n0", "10.0.0.1", adress="x"), "node 'n0': unknown key 'adress' (did you mean address?)"),
        (node("n0", "10.0.0.1", port="22"), "node 'n0': port must be an integer, got '22'"),
        (node("n0", "not an address"), "node 'n0': address 'not an address' is not an IP address or host name"),
        (node("n0", "10.0.0.1", key="missing_key"), "node 'n0': SSH key"),
        ('usr = "me"\n' + node("n0", "10.0.0.1"), "unknown key 'usr' (did you mean user?)"),
        ("rdzv_port = 70000\n" + node("n0", "10.0.0.1"), "rdzv_port must be a TCP port (1-65535), got 70000"),
    ],
    ids=[
        "no-nodes",
        "no-address",
        "duplicate-address",
        "duplicate-name",
        "two-masters",
        "unknown-node-key",
        "port-type",
        "bad-address",
        "missing-key-file",
        "unknown-cluster-key",
        "bad-rdzv-port",
    ],
)
def test_bad_inline_inventory(tmp_path: Path, body: str, expected: str) -> None:
    line = run(tmp_path, HEAD + body)
    assert expected in line, line


def test_inventory_file_errors(tmp_path: Path) -> None:
    line = run(tmp_path, HEAD + 'inventory = "hosts.toml"\n')
    assert line == f"error: inventory {tmp_path / 'hosts.toml'} not found", line

    line = run(tmp_path, HEAD + 'inventory = "hosts.toml"\n', files={"hosts.toml": "[[nodes]\n"})
    assert line.startswith(f"error: inventory {tmp_path / 'hosts.toml'}: invalid TOML"), line

    bad = node("n0", "10.0.0.1").replace("clusters.lab.", "") + '[[nodes]]\nname = "n1"\naddress = "10.0.0.1"\n'
    line = run(tmp_path, HEAD + 'inventory = "hosts.toml"\n', files={"hosts.toml": bad})
    assert f"inventory {tmp_path / 'hosts.toml'}: node 'n1' has the same address 10.0.0.1 as node 'n0'" in line

    line = run(tmp_path, HEAD + 'inventory = "hosts.toml"\n' + node("n0", "10.0.0.1"), files={"hosts.toml": ""})
    assert "give the nodes inline or in inventory" in line


def test_multi_node_needs_shared_output(tmp_path: Path) -> None:
    toml = HEAD + node("n0", "127.0.0.1") + node("n1", "127.0.0.2")
    line = run(tmp_path, toml, "train", "mnist", "--cluster", "lab", "--output", str(tmp_path / "runs"))
    assert "a run on 2 nodes needs --output that every node reaches: a gs://bucket/prefix" in line


def test_unreachable_node_is_named(tmp_path: Path) -> None:
    port = closed_port()
    toml = HEAD + node("n0", "127.0.0.1", port=port)
    line = run(tmp_path, toml, "train", "mnist", "--cluster", "lab", "--output", str(tmp_path / "runs"))
    assert line == (
        f"error: node n0 (127.0.0.1:{port}): nothing accepts SSH connections on port {port} (is sshd running?)"
    ), line
    assert not (tmp_path / "runs").exists()


def test_unknown_cluster_lists_defined(tmp_path: Path) -> None:
    line = run(tmp_path, HEAD + node("n0", "10.0.0.1"), "train", "mnist", "--cluster", "lba")
    assert "unknown cluster 'lba'" in line and "defines: lab" in line, line
