"""The multi-host test bed itself: addresses, isolation, strict host keys, blocked ports, the GCS emulator, teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from .bed import TESTBED_PY, Testbed, ssh_argv

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.root


def ssh(bed: Testbed, host, known_hosts: Path, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ssh_argv(bed, host, known_hosts), command], capture_output=True, text=True, timeout=30)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (killed sshd children wait a moment for init to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def connect_argv(address: str, port: int, timeout: float = 3.0) -> list[str]:
    """A python3 one-liner that TCP-connects to address:port (exit 0) or fails (exit 1)."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), {timeout}).close()"
    return [sys.executable, "-c", code]


def test_cluster_toml(testbed):
    env = {"STORAGE_EMULATOR_HOST": "http://x:1"}
    text = testbed.cluster_toml("bed", "/usr/bin/python3", env=env, known_hosts="/k")
    cluster = tomllib.loads(text)["clusters"]["bed"]
    nodes = cluster.pop("nodes")
    assert cluster == {
        "backend": "hosts", "user": "root", "key": str(testbed.root / "id_ed25519"), "python": "/usr/bin/python3",
        "rdzv_port": 29400, "known_hosts": "/k", "env": env,
    }  # fmt: skip
    assert [n.pop("master", False) for n in nodes] == [True, False]
    assert nodes == [{"name": h.name, "address": h.address, "workdir": str(h.workdir)} for h in testbed.hosts]
    with_nic = tomllib.loads(testbed.cluster_toml("b", "py", interface="eth0"))["clusters"]["b"]["nodes"]
    assert [n["interface"] for n in with_nic] == ["eth0", "eth0"]
    assert "env" not in tomllib.loads(testbed.cluster_toml("b", "py"))["clusters"]["b"]


def test_each_host_has_its_own_address_and_no_default_route(testbed, known_hosts):
    k = testbed.state["k"]
    for i, host in enumerate(testbed.hosts):
        assert host.address == f"10.213.{k}.{11 + i}"
        r = ssh(testbed, host, known_hosts, "ip -4 -o addr show eth0")
        assert r.returncode == 0, r.stderr
        assert f"inet {host.address}/24" in r.stdout
        routes = ssh(testbed, host, known_hosts, "ip -4 route show").stdout.splitlines()
        assert routes == [f"10.213.{k}.0/24 dev eth0 proto kernel scope link src {host.address} "]
        kernel_routes = ssh(testbed, host, known_hosts, "cat /proc/net/route").stdout.splitlines()[1:]
        # Only 10.213.k.0 (little-endian hex); a default route would show as destination 00000000.
        assert [line.split()[:2] for line in kernel_routes] == [["eth0", f"00{k:02X}D50A"]]
        assert host.workdir.is_dir() and host.workdir == testbed.root / host.name / "work"


def test_master_reaches_worker_over_ssh(testbed, known_hosts):
    h0, h1 = testbed.hosts
    script = f'python3 -c \'import socket; socket.create_connection(("{h1.address}", 22), 3).close(); print("ok")\''
    r = ssh(testbed, h0, known_hosts, script)
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr
    # The processes of that session ran inside h0's namespace; sshd is there too.
    assert testbed.pids(h0) and all(alive(pid) for pid in testbed.pids(h0))


def test_unknown_host_key_is_refused(testbed, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    r = ssh(testbed, testbed.hosts[1], empty, "true")
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr


def test_wrong_host_key_is_refused(testbed, tmp_path):
    h0, h1 = testbed.hosts
    swapped = tmp_path / "known_hosts"
    swapped.write_text(f"{h1.address} {' '.join(h0.host_key_pub.split()[:2])}\n")
    r = ssh(testbed, h1, swapped, "true")
    assert r.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in r.stderr, r.stderr


def test_block_port(testbed):
    h0, h1 = testbed.hosts
    assert testbed.exec(h0, connect_argv(h1.address, 22)).returncode == 0
    testbed.block_port(h1, 22)
    try:
        r = testbed.exec(h0, connect_argv(h1.address, 22, timeout=1.0), capture_output=True, text=True)
        assert r.returncode != 0 and "timed out" in r.stderr, r.stderr
    finally:
        testbed.unblock_port(h1, 22)
    assert testbed.exec(h0, connect_argv(h1.address, 22)).returncode == 0


def test_gcs_emulator_reachable_from_root_and_other_host(testbed, monkeypatch):
    storage = pytest.importorskip("google.cloud.storage", reason="needs google-cloud-storage")
    pytest.importorskip("gcp_storage_emulator", reason="needs gcp-storage-emulator")
    from google.auth.credentials import AnonymousCredentials

    h0, h1 = testbed.hosts
    url = testbed.start_gcs_emulator(h0)
    assert url == f"http://{h0.address}:9023"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    name = f"dtrain-test-{uuid.uuid4().hex[:12]}"
    client = storage.Client(project="dtrain-test", credentials=AnonymousCredentials())
    client.create_bucket(name).blob("a/b.txt").upload_from_string(b"hello")
    code = textwrap.dedent(f"""
        import json, urllib.request
        base = {url!r} + "/storage/v1/b"
        listing = json.load(urllib.request.urlopen(base + "?project=x", timeout=5))
        print(json.dumps([b["name"] for b in listing["items"]]))
        print(urllib.request.urlopen(base + "/{name}/o/a%2Fb.txt?alt=media", timeout=5).read().decode())
    """)
    r = testbed.exec(h1, [sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    buckets, body = r.stdout.splitlines()
    assert name in json.loads(buckets) and body == "hello"


def test_destroy_leaves_nothing_and_is_idempotent(testbed, tmp_path):
    root = tmp_path / "small"
    bed = Testbed.create(1, root)
    (host,) = bed.hosts
    pids = bed.pids(host)
    assert pids and bed.hosts[0].address.startswith("10.213.") and bed.state["k"] != testbed.state["k"]
    bed.destroy()
    bed.destroy()
    assert host.namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert bed.bridge not in links and bed.prefix not in links
    assert not any(alive(pid) for pid in pids)
    assert not root.exists()
    assert not (Path("/run/dtrain-testbed") / f"{bed.prefix}.json").exists()
    # The module's test bed is untouched.
    assert all(testbed.pids(h) for h in testbed.hosts)


def test_cleanup_stale_removes_a_crashed_owners_test_bed(testbed, tmp_path):
    root = tmp_path / "crashed"
    code = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("tb", {str(TESTBED_PY)!r})
tb = importlib.util.module_from_spec(spec); sys.modules["tb"] = tb; spec.loader.exec_module(tb)
bed = tb.Testbed.create(1, tb.Path({str(root)!r}))
print(bed.prefix, bed.hosts[0].namespace, flush=True)
time.sleep(60)
"""
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        prefix, namespace = owner.stdout.readline().split()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    Testbed.cleanup_stale()  # (a concurrent run's create() may have reaped it already: check the effect)
    assert namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not root.exists() and not Path(f"/sys/class/net/dtbr{prefix[2:]}").exists()
    assert all(testbed.pids(h) for h in testbed.hosts)  # the live test bed is not stale


def test_a_pyenv_lock_left_by_a_killed_login_is_released(tmp_path, monkeypatch):
    """crash() (or a run stopped by SIGKILL) kills login shells mid-flight; one killed during pyenv's rehash
    (root's .bashrc runs `pyenv init` on these machines) leaves shims/.pyenv-shim, and every later SSH login waits
    60 s on it. Logins waiting for it are pyenv-rehash processes too, so only its age says it is stale; a test bed
    watches for it while it lives."""
    from .bed import testbed as module

    lock = tmp_path / "shims" / ".pyenv-shim"
    lock.parent.mkdir()
    lock.write_text("")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    waiting = subprocess.Popen(["bash", "-c", "exec -a pyenv-rehash sleep 30"])  # a login waiting for it
    try:
        assert not module._release_pyenv_lock() and lock.exists()  # fresh: a rehash at work holds it
        os.utime(lock, (time.time() - 60, time.time() - 60))
        assert module._release_pyenv_lock() and not lock.exists()  # old: its holder is dead, waiters or not
    finally:
        waiting.kill()
        waiting.wait()
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    watch = module._PyenvLockWatch(every_s=0.1)
    try:
        deadline = time.monotonic() + 10
        while lock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not lock.exists()
    finally:
        watch.stop()
