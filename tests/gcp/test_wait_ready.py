"""`dtrain up`'s wait for the nodes, against a real sshd: a node that answers SSH but keeps refusing
the cluster's key (an organisation that enforces OS Login ignores metadata keys) ends the wait in
about KEY_REFUSED_S, with what to do, rather than after the whole ready timeout (900 s by default)."""

from __future__ import annotations

import getpass
import subprocess
import time

import pytest

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Collector, Handle
from dtrain.control.gcp import lifecycle

from .sshd import loopback_sshd


@pytest.fixture
def key(tmp_path):
    path = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def cluster(port: int, key, tmp_path) -> Cluster:
    node = Node(name="demo-master", address="127.0.0.1", port=port, user=getpass.getuser(), key=str(key), master=True)
    return Cluster(name="demo", backend="gcp", nodes=(node,), known_hosts=tmp_path / "known_hosts")


def test_a_node_that_refuses_the_key_ends_the_wait_early(tmp_path, key, monkeypatch):
    monkeypatch.setattr(lifecycle, "KEY_REFUSED_S", 2.0)
    monkeypatch.setattr(lifecycle, "READY_POLL_S", 0.5)
    with loopback_sshd(tmp_path / "sshd", tmp_path / "authorized_keys") as port:  # no key authorized
        start = time.monotonic()
        with pytest.raises(UserError) as e:
            lifecycle.wait_ready(
                cluster(port, key, tmp_path),
                timeout=60,
                events=Collector(),
                handle=Handle(),
                refused_hint="set os_login = true",
            )
        elapsed = time.monotonic() - start
    assert str(e.value) == (
        f"node demo-master answers SSH but has refused the cluster's key for 2 s (user {getpass.getuser()}): "
        "set os_login = true"
    )
    assert e.value.exit_code == ExitCode.FAILURE
    assert elapsed < 30, elapsed


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_a_node_that_takes_the_key_and_is_ready_passes(tmp_path, key, monkeypatch):
    # The same wait on a node that authorizes the key and whose startup script has reported: ready.
    ready = tmp_path / "ready"
    ready.write_text('{"ok": true, "gpus": 0}\n')
    monkeypatch.setattr(lifecycle, "READY_FILE", str(ready))
    keys = tmp_path / "authorized_keys"
    keys.write_text(key.with_suffix(".pub").read_text())
    events = Collector()
    with loopback_sshd(tmp_path / "sshd", keys) as port:
        lifecycle.wait_ready(cluster(port, key, tmp_path), timeout=60, events=events, handle=Handle())
    assert [e.message for e in events.events if e.kind == "check"] == ["ready demo-master"]
