"""A node recreated under the same name (autostop's "delete" then `dtrain up`, a change of `spot`) comes back
with a new SSH host key. Reached through IAP by name, its old key is still in the cluster's known_hosts, and
accept-new refuses the new one. Against real sshds: the node is "recreated" by starting a second sshd with a
freshly generated host key behind the same alias (a ProxyCommand relay, as IAP's tunnel is); the record's
instance id tells `dtrain up` which node is new (lifecycle.forget_replaced_host_keys)."""

from __future__ import annotations

import getpass
import subprocess
import sys
import time

import pytest

from dtrain.common.errors import UserError
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Collector, Handle
from dtrain.control.gcp import lifecycle

from .sshd import loopback_sshd

RELAY = r"""
import socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while data := sys.stdin.buffer.read1(65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    sys.stdout.buffer.write(data); sys.stdout.buffer.flush()
"""
OTHER = "demo-worker-0 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk\n"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    keys = tmp_path / "authorized_keys"
    keys.write_text(key.with_suffix(".pub").read_text())
    ready = tmp_path / "ready"
    ready.write_text('{"ok": true, "gpus": 0}\n')
    monkeypatch.setattr(lifecycle, "READY_FILE", str(ready))
    monkeypatch.setattr(lifecycle, "READY_POLL_S", 0.5)
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    return tmp_path, key, keys, relay


def cluster(tmp_path, key, relay, port: int) -> Cluster:
    # As backends/gcp.py builds a node without an external IP: ssh to its name, through a ProxyCommand.
    node = Node(name="demo-master", address="10.0.0.2", user=getpass.getuser(), key=str(key), master=True,
                ssh_host="demo-master", proxy_command=f"{sys.executable} {relay} {port}")  # fmt: skip
    return Cluster(name="demo", backend="gcp", nodes=(node,), known_hosts=tmp_path / "known_hosts")


def record(instance_id: str) -> dict:
    return {"nodes": [{"name": "demo-master", "external_ip": "", "instance_id": instance_id},
                      {"name": "demo-worker-0", "external_ip": "", "instance_id": "77"}]}  # fmt: skip


def known_key(tmp_path) -> str:
    lines = [ln for ln in (tmp_path / "known_hosts").read_text().splitlines() if ln.startswith("demo-master ")]
    assert len(lines) == 1, lines
    return lines[0].split()[2]


def host_key(root) -> str:
    return (root / "host_ed25519.pub").read_text().split()[1]


def test_a_recreated_node_is_trusted_again_and_only_it(setup):
    tmp_path, key, keys, relay = setup
    with loopback_sshd(tmp_path / "sshd1", keys) as port:
        lifecycle.wait_ready(cluster(tmp_path, key, relay, port), timeout=60, events=Collector(), handle=Handle())
    assert known_key(tmp_path) == host_key(tmp_path / "sshd1")
    with (tmp_path / "known_hosts").open("a") as f:
        f.write(OTHER)  # another node's line, which must survive

    # The VM is deleted and made again: same name, new host key (a fresh sshd, its key generated anew).
    with loopback_sshd(tmp_path / "sshd2", keys) as port:
        assert host_key(tmp_path / "sshd2") != host_key(tmp_path / "sshd1")
        # Without forgetting, accept-new refuses the changed key, and the wait ends at once (not after the
        # ready timeout) with what happened.
        start = time.monotonic()
        with pytest.raises(UserError, match="host key CHANGED"):
            lifecycle.wait_ready(cluster(tmp_path, key, relay, port), timeout=60, events=Collector(), handle=Handle())
        assert time.monotonic() - start < 30
        # The same instance id: nothing is forgotten (a changed key there stays an alarm).
        assert lifecycle.forget_replaced_host_keys(tmp_path / "known_hosts", record("1"), record("1")) == []
        assert known_key(tmp_path) == host_key(tmp_path / "sshd1")
        # `dtrain up` sees a new instance id for demo-master: its line goes, and only its line.
        assert lifecycle.forget_replaced_host_keys(tmp_path / "known_hosts", record("1"), record("2")) == [
            "demo-master"
        ]
        assert OTHER in (tmp_path / "known_hosts").read_text()
        lifecycle.wait_ready(cluster(tmp_path, key, relay, port), timeout=60, events=Collector(), handle=Handle())
    assert known_key(tmp_path) == host_key(tmp_path / "sshd2")
    assert OTHER in (tmp_path / "known_hosts").read_text()


def test_forgetting_by_instance_id_only(tmp_path):
    hosts = tmp_path / "known_hosts"
    lines = [
        "demo-master ssh-ed25519 AAAAold\n",
        "34.1.2.3 ssh-ed25519 AAAAip\n",
        "[demo-worker-0]:2222 ssh-ed25519 AAAAport\n",
        "demo-worker-1 ssh-ed25519 AAAAkept\n",
        "demo-master-2 ssh-ed25519 AAAAother-cluster\n",
    ]
    hosts.write_text("".join(lines))
    before = {"nodes": [
        {"name": "demo-master", "external_ip": "34.1.2.3", "instance_id": "1"},
        {"name": "demo-worker-0", "external_ip": "", "instance_id": "2"},
        {"name": "demo-worker-1", "external_ip": "", "instance_id": "3"},
    ]}  # fmt: skip
    after = {"nodes": [
        {"name": "demo-master", "external_ip": "34.9.9.9", "instance_id": "11"},
        {"name": "demo-worker-0", "external_ip": "", "instance_id": "12"},
        {"name": "demo-worker-1", "external_ip": "", "instance_id": "3"},
    ]}  # fmt: skip
    assert lifecycle.forget_replaced_host_keys(hosts, before, after) == ["demo-master", "demo-worker-0"]
    assert hosts.read_text() == lines[3] + lines[4]
    # A record from before instance ids were kept: nothing can be told, nothing is dropped.
    hosts.write_text("".join(lines))
    old = {"nodes": [{k: v for k, v in n.items() if k != "instance_id"} for n in before["nodes"]]}
    assert lifecycle.forget_replaced_host_keys(hosts, old, after) == [] and hosts.read_text() == "".join(lines)
