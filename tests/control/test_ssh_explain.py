"""ssh's failures as one line: where ssh (exit 255) printed nothing, the line still says what the exit code
means and how to see more, never "no message"; where it printed something unknown, that and the code."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dtrain.control.cluster import Cluster, Node
from dtrain.control.ssh import SSH, SSH_FAILED, NodeError, explain

NODE = Node("login", "10.0.0.9", user="alice", port=2222)


def test_an_ssh_failure_without_a_message_names_the_code_and_its_usual_cause(tmp_path: Path):
    line = explain("", NODE, tmp_path / "known_hosts")
    assert line == (
        "ssh exited 255 without a message: 255 is ssh's own failure (the connection, the login or the host key), "
        "not the remote command's; `ssh -v -p 2222 alice@10.0.0.9` shows which"
    )
    assert "no message" not in explain("  \n", NODE, tmp_path / "known_hosts")


def test_an_unknown_complaint_keeps_its_text_and_the_code(tmp_path: Path):
    line = explain("mux_client_request_session: session request failed: Session open refused by peer\n", NODE,
                   tmp_path / "kh")  # fmt: skip
    assert (
        line
        == "ssh failed (exit 255): mux_client_request_session: session request failed: Session open refused by peer"
    )


def test_a_real_ssh_that_cannot_connect_raises_one_line(tmp_path: Path):
    """A real ssh whose tunnel (ProxyCommand) closes at once: exit 255, one NodeError line."""
    node = Node("login", "10.0.0.9", user="alice", proxy_command="sh -c 'exit 0'")
    cluster = Cluster(name="lab", backend="hosts", nodes=(node,), known_hosts=tmp_path / "known_hosts")
    ssh = SSH(cluster)
    try:
        ssh.run(node, "true", timeout=30)
    except NodeError as e:
        assert str(e).startswith("node login (alice@10.0.0.9:22): ") and "\n" not in str(e), str(e)
        assert "no message" not in str(e)
    else:
        raise AssertionError("ssh through a closed tunnel succeeded")
    p = subprocess.run([*ssh.argv(node, master=False), "true"], capture_output=True)
    assert p.returncode == SSH_FAILED
