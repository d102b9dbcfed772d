"""`dtrain train --cluster` on a real multi-host test bed: two network namespaces, each with its own
address and sshd (scripts/testbed.py), checkpoints in a gcp-storage-emulator running inside h0.
Everything goes through the real CLI, OpenSSH, torchrun and gloo; nothing is mocked.

Needs root (skips otherwise; CI runs as root) and Debian's Fashion-MNIST files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from runs import CLI, isolated_env, stop_labels

from dtrain.common.checkpoint import find_latest
from dtrain.common.errors import ExitCode
from dtrain.common.rundir import checkpoints, read_json
from dtrain.common.storage import open_store

from .bed import Testbed, ssh_argv

pytestmark = pytest.mark.root

FASHION = Path("/usr/share/datasets/fashion-mnist")
# 2 hosts x 2 processes, 2 epochs over 16,000 images: 62 steps an epoch at the global batch of 256.
EPOCHS, TRAIN_IMAGES, BATCH = 2, 16_000, 256
TOTAL_STEPS = EPOCHS * (TRAIN_IMAGES // BATCH)
MNIST = ["train", "mnist", "--cluster", "bed", "--dataset", "fashion-mnist", "--epochs", str(EPOCHS),
         "--train-split", f"train[:{TRAIN_IMAGES}]", "--batch-size", str(BATCH), "--nproc", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def emulator(testbed: Testbed) -> str:
    return testbed.start_gcs_emulator(testbed.hosts[0])


@pytest.fixture(scope="module")
def cwd(testbed: Testbed, known_hosts: Path, emulator: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose dtrain.toml describes the test bed as cluster `bed`."""
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it as root)")
    d = tmp_path_factory.mktemp("cluster-cwd")
    toml = testbed.cluster_toml("bed", sys.executable, env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known_hosts)
    (d / "dtrain.toml").write_text(toml)
    return d


def cli_env(cwd: Path, emulator: str) -> dict[str, str]:
    return isolated_env(
        cwd,
        STORAGE_EMULATOR_HOST=emulator,
        XDG_CONFIG_HOME=str(cwd / "config"),
        XDG_CACHE_HOME=str(cwd / "xdg-cache"),
        COLUMNS="200",
        # The checkpoint directory is copied every 0.5 s, not 30: the tests wait for a checkpoint in the bucket.
        DTRAIN_INTERNAL_MIRROR_INTERVAL_S="0.5",
    )


def bucket(emulator: str) -> str:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    os.environ["STORAGE_EMULATOR_HOST"] = emulator
    name = f"dtrain-bed-{uuid.uuid4().hex[:10]}"
    storage.Client(project="dtrain-test", credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}/runs"


def dtrain(cwd: Path, emulator: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=cli_env(cwd, emulator), capture_output=True, text=True, timeout=timeout
    )


def start(cwd: Path, emulator: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=cli_env(cwd, emulator), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def host_processes(bed: Testbed, keep: Callable[[str], bool]) -> dict[str, list[str]]:
    """Each host's processes whose command line `keep` accepts, as "pid command line"."""
    out: dict[str, list[str]] = {}
    for h in bed.hosts:
        found = []
        for pid in bed.pids(h):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if keep(cmd):
                found.append(f"{pid} {cmd}")
        out[h.name] = found
    return out


def job_processes(bed: Testbed, workers_only: bool = False) -> dict[str, list[str]]:
    """Each host's processes of a dtrain job (agent, torchrun, workers), as command lines."""

    def keep(cmd: str) -> bool:
        if "dtrain." not in cmd:
            return False
        return not (workers_only and ("dtrain.common." in cmd or ".train" not in cmd))

    return host_processes(bed, keep)


def run_of(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if " run " in ln and ln.startswith(("starting", "resuming"))]
    return line.split(" run ", 1)[1].split()[0]


def latest_checkpoint(url: str) -> int:
    # Written in each node's checkpoint directory, copied to the run's ckpt/ (read in place: rundir.checkpoints).
    found = find_latest(checkpoints(open_store(url)), lambda _m: None)
    return found.step if found is not None else -1


def wait_for_checkpoint(p: subprocess.Popen, out: str, step: int, timeout: float = 240) -> str:
    """The run's URL under `out` once its checkpoint at `step` (or later) is complete; the job must keep running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = open_store(out).list("")
        if files:
            run_url = f"{out}/{files[0].split('/')[0]}"
            if latest_checkpoint(run_url) >= step:
                return run_url
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.5)
    pytest.fail(f"no checkpoint at step {step} within {timeout:.0f} s")


@pytest.mark.slow  # 36 s; the default suite keeps a two-host run in test_ctrl_c_leaves_no_process_on_any_host
def test_two_hosts_two_processes_train_to_the_bucket(cwd: Path, emulator: str, testbed: Testbed) -> None:
    out = bucket(emulator)
    r = dtrain(cwd, emulator, *MNIST, "--output", out, "--checkpoint-every", "40")
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = run_of(r.stdout)
    run = open_store(f"{out}/{run_id}")
    status = read_json(run, "status.json")
    assert status["state"] == "completed"
    assert {p["host"] for p in status["peers"]} and len(status["peers"]) == 4  # 2 hosts x 2 processes
    final = status["result"]
    assert final["accuracy"] >= 0.80 and final["steps"] == TOTAL_STEPS and final["world_size"] == 4, final
    # Checkpoints in the bucket (the checkpoint directory's copies): the periodic ones and the last, each complete.
    steps = sorted({int(f.split("/")[0].split("-")[1]) for f in checkpoints(run).list("") if f.endswith("/meta.json")})
    assert TOTAL_STEPS in steps and len(steps) >= 2, steps
    assert latest_checkpoint(run.url) == TOTAL_STEPS
    # Output streamed with node prefixes, and kept per node under the run.
    assert "[h0] " in r.stdout and "epoch 2/2: eval accuracy" in r.stdout
    logs = run.list("logs")
    assert logs == ["logs/h0.log", "logs/h1.log"], logs
    replay = dtrain(cwd, emulator, "logs", run_id, "--output", out)
    assert replay.returncode == 0 and "[h0] " in replay.stdout and "eval accuracy" in replay.stdout
    # Resource curves: each host's agent sampled it (every 5 s, the default) and the launcher recorded the rows
    # and each rank's peak (torch and the model: well over 100 MiB of RSS a rank).
    assert run.list("resources") == ["resources/h0.jsonl", "resources/h1.jsonl"]
    for host in ("h0", "h1"):
        rows = [json.loads(x) for x in run.read_bytes(f"resources/{host}.jsonl").decode().splitlines()]
        assert rows and [x["time"] for x in rows] == sorted(x["time"] for x in rows)
        assert all(x["node"] == host and 0 < x["mem_used"] < x["mem_total"] for x in rows)
    peaks = status["peak_memory"]
    assert sorted(peaks) == ["0", "1", "2", "3"], peaks
    assert sorted(p["node"] for p in peaks.values()) == ["h0", "h0", "h1", "h1"]
    assert all(p["rss_peak"] >= 100 << 20 for p in peaks.values()), peaks
    # Nothing of the job is left on either host.
    assert job_processes(testbed) == {"h0": [], "h1": []}


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_worker_killed_mid_run_recovers_from_last_checkpoint(cwd: Path, emulator: str, testbed: Testbed) -> None:
    out = bucket(emulator)
    p = start(cwd, emulator, *MNIST, "--output", out, "--checkpoint-every", "20", "--max-restarts", "2")
    try:
        run_url = wait_for_checkpoint(p, out, 20)
        killed_at_ckpt = latest_checkpoint(run_url)
        workers = job_processes(testbed, workers_only=True)["h1"]
        assert len(workers) == 2, workers
        for w in workers:
            os.kill(int(w.split()[0]), signal.SIGKILL)
        text, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, text
    run = open_store(run_url)
    status = read_json(run, "status.json")
    assert status["state"] == "completed" and status["result"]["steps"] == TOTAL_STEPS, status
    assert status["result"]["accuracy"] >= 0.80, status["result"]
    config = read_json(run, "config.json")
    assert len(config.get("resumes", [])) == 1, config.get("resumes")  # torchrun restarted the job once
    resumed = [int(ln.rsplit("(step ", 1)[1].rstrip(")")) for ln in text.splitlines() if "] resuming from " in ln]
    assert len(resumed) == 1 and resumed[0] >= killed_at_ckpt, text  # from the last complete checkpoint
    assert job_processes(testbed) == {"h0": [], "h1": []}


def test_ctrl_c_leaves_no_process_on_any_host(cwd: Path, emulator: str, testbed: Testbed) -> None:
    out = bucket(emulator)
    p = start(cwd, emulator, *MNIST, "--output", out)
    try:
        deadline = time.monotonic() + 120
        while not all(job_processes(testbed, workers_only=True).values()):
            assert time.monotonic() < deadline, "workers never started"
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.2)
        time.sleep(3)  # into training
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        left = job_processes(testbed)
        while any(left.values()) and time.monotonic() - t0 < 10:
            time.sleep(0.2)
            left = job_processes(testbed)
        assert not any(left.values()), f"still running {time.monotonic() - t0:.1f} s after Ctrl-C: {left}"
        text, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == ExitCode.INTERRUPTED, text
    assert "interrupted: stopping the job on every node" in text


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_blocked_rendezvous_port_is_named(cwd: Path, emulator: str, testbed: Testbed) -> None:
    h0, h1 = testbed.hosts
    testbed.block_port(h0, 29400)
    try:
        doc = dtrain(cwd, emulator, "doctor", "--cluster", "bed", timeout=120)
        assert doc.returncode == ExitCode.FAILURE, doc.stdout + doc.stderr
        wanted = f"node h1 cannot reach h0 ({h0.address}:29400) on TCP port 29400, the rendezvous port (timed out)"
        assert wanted in " ".join((doc.stdout + doc.stderr).split()), doc.stdout + doc.stderr
        t0 = time.monotonic()
        r = dtrain(cwd, emulator, *MNIST, "--output", bucket(emulator), timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        testbed.unblock_port(h0, 29400)
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert f"error: {wanted}: open it between the nodes" in r.stderr, r.stderr
    assert elapsed < 60, elapsed
    assert job_processes(testbed) == {"h0": [], "h1": []}


def test_doctor_gpus_exec_on_a_healthy_cluster(cwd: Path, emulator: str, testbed: Testbed) -> None:
    doc = dtrain(cwd, emulator, "doctor", "--cluster", "bed", "--mib", "8", timeout=180)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    text = " ".join(doc.stdout.split())
    assert "gloo, 4 ranks" not in text  # one process per CPU node for the check
    assert "gloo, 2 ranks, 8 MiB" in text and "busbw" in text, text
    g = dtrain(cwd, emulator, "gpus", "--cluster", "bed", "--json")
    assert g.returncode == 0, g.stderr
    assert '"h0": "no GPU (CPU only: nvidia-smi not found)"' in g.stdout, g.stdout
    e = dtrain(cwd, emulator, "exec", "all", "--cluster", "bed", "--", "ip", "-4", "-o", "addr", "show", "eth0")
    assert e.returncode == 0, e.stderr
    for h in testbed.hosts:
        assert any(ln.startswith(f"[{h.name}] ") and h.address in ln for ln in e.stdout.splitlines()), e.stdout
    bad = dtrain(cwd, emulator, "exec", "h1", "--cluster", "bed", "--", "false")
    assert bad.returncode == 1


def test_host_keys_unknown_accepted_changed(cwd: Path, emulator: str, testbed: Testbed, tmp_path: Path) -> None:
    fresh = tmp_path / "known_hosts"
    toml = testbed.cluster_toml("bed", sys.executable, known_hosts=fresh)
    (tmp_path / "dtrain.toml").write_text(toml)
    h0 = testbed.hosts[0]
    for command in (["exec", "h0", "--cluster", "bed", "--", "true"], ["gpus", "--cluster", "bed"]):
        r = dtrain(tmp_path, emulator, *command)
        assert r.returncode == ExitCode.USAGE
        assert r.stderr.startswith(
            f"error: node h0 (root@{h0.address}:22): its host key is not in dtrain's known_hosts ({fresh}); "
            "check the machine is the one you mean, then run again with --accept-new-host-keys"
        ), r.stderr
    r = dtrain(tmp_path, emulator, "gpus", "--cluster", "bed", "--accept-new-host-keys")
    assert r.returncode == 0, r.stderr
    assert h0.host_key_pub.split()[1] in fresh.read_text()
    # A key that changed is refused even with --accept-new-host-keys.
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    lines = [ln for ln in fresh.read_text().splitlines() if not ln.startswith(h0.address + " ")]
    assert len(lines) == 1  # h1's line; names are stored in clear (HashKnownHosts=no)
    lines.append(f"{h0.address} {' '.join((other.with_suffix('.pub')).read_text().split()[:2])}")
    fresh.write_text("\n".join(lines) + "\n")
    r = dtrain(tmp_path, emulator, "gpus", "--cluster", "bed", "--accept-new-host-keys")
    assert r.returncode == ExitCode.USAGE
    assert "node h0" in r.stderr and "its host key CHANGED since it was trusted" in r.stderr, r.stderr


def test_wrong_key_and_unreachable_node_are_named(cwd: Path, emulator: str, testbed: Testbed, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    toml = testbed.cluster_toml("bed", sys.executable, known_hosts=testbed.root / "known_hosts")
    (tmp_path / "dtrain.toml").write_text(toml.replace(str(testbed.key), str(wrong)))
    r = dtrain(tmp_path, emulator, "gpus", "--cluster", "bed")
    assert r.returncode == ExitCode.USAGE
    assert f"the SSH login was refused (wrong key or user): key {wrong}, user root" in r.stderr, r.stderr

    gone = testbed.hosts[1].address.rsplit(".", 1)[0] + ".99"  # in the test bed's range, no host there
    (tmp_path / "dtrain.toml").write_text(toml.replace(testbed.hosts[1].address, gone))
    t0 = time.monotonic()
    r = dtrain(tmp_path, emulator, "gpus", "--cluster", "bed")
    assert r.returncode == ExitCode.USAGE
    assert f"error: node h1 (root@{gone}:22): unreachable" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 40


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_worker_killed_without_restarts_fails_fast(cwd: Path, emulator: str, testbed: Testbed) -> None:
    p = start(cwd, emulator, *MNIST, "--output", bucket(emulator))
    try:
        deadline = time.monotonic() + 120
        while len(job_processes(testbed, workers_only=True)["h1"]) < 2:
            assert time.monotonic() < deadline, "workers never started"
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.2)
        time.sleep(5)
        for w in job_processes(testbed, workers_only=True)["h1"]:
            os.kill(int(w.split()[0]), signal.SIGKILL)
        t0 = time.monotonic()
        text, _ = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == ExitCode.FAILURE, text
    assert elapsed < 45, elapsed  # the survivors see the dead peer, or are killed after FAIL_FAST_GRACE_S
    assert "continues from its last complete checkpoint" in text
    assert job_processes(testbed) == {"h0": [], "h1": []}


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_sigterm_to_one_nodes_processes_ends_the_run_preempted_with_one_label(
    cwd: Path, emulator: str, testbed: Testbed
) -> None:
    """A Spot notice on one node: SIGTERM to its torchrun and ranks, not through dtrain. Every rank stops at the
    same step after a checkpoint; the node's torchrun dies of the signal (143) and the other node's exits 3. The
    run is preempted (exit 3) with exactly one stop label, `preempted`, at that checkpoint (it ended `failed (exit
    1)`, with rank 0's own `preempted` row beside it)."""
    out = bucket(emulator)
    p = start(cwd, emulator, *MNIST, "--output", out, "--checkpoint-every", "20")
    try:
        run_url = wait_for_checkpoint(p, out, 20)
        procs = [w for w in job_processes(testbed)["h1"] if "dtrain.common.nodeagent" not in w]
        assert len(procs) >= 3 and any("dtrain.common.launch" in w for w in procs), procs  # torchrun, 2 ranks
        for w in procs:
            os.kill(int(w.split()[0]), signal.SIGTERM)
        text, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == ExitCode.PREEMPTED, text
    run = open_store(run_url)
    status = read_json(run, "status.json")
    assert (status["state"], status["exit_code"]) == ("preempted", ExitCode.PREEMPTED), status
    rows = [json.loads(x) for x in run.read_bytes("events.jsonl").decode().splitlines() if x.strip()]
    assert stop_labels(rows) == ["preempted"], rows
    (label,) = [r for r in rows if r["event"] == "preempted"]
    assert label["step"] == latest_checkpoint(run_url) >= 20, (label, latest_checkpoint(run_url))
    assert job_processes(testbed) == {"h0": [], "h1": []}


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_debian_style_hostnames_need_no_interface_key(
    cwd: Path, emulator: str, testbed: Testbed, known_hosts: Path, tmp_path: Path
) -> None:
    """Each host's hostname resolves to 127.0.1.1 (Debian's /etc/hosts, which the test bed gives every
    namespace) and the inventory names no interface. dtrain finds the interface that holds each node's
    cluster address: doctor says which, and its 2-rank gloo all-reduce across the hosts passes (the
    2-node training above runs the same way). A node whose address is on none of its interfaces is
    named with the cause, in one line."""
    assert "interface" not in (cwd / "dtrain.toml").read_text()
    for h in testbed.hosts:
        r = subprocess.run(
            ssh_argv(testbed, h, known_hosts) + ["getent hosts $(hostname)"], capture_output=True, text=True
        )
        assert r.stdout.split()[0] == "127.0.1.1", r.stdout + r.stderr
    doc = dtrain(cwd, emulator, "doctor", "--cluster", "bed", "--mib", "8", timeout=180)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    text = " ".join(doc.stdout.split())
    for h in testbed.hosts:
        assert f"{h.address} is on eth0: gloo/NCCL use it" in text, text
    assert "gloo, 2 ranks, 8 MiB" in text, text

    # h1 listed at an address it does not hold (reached over SSH at its real one): the cause, named.
    k = testbed.state["k"]
    toml = testbed.cluster_toml("bad", sys.executable, known_hosts=known_hosts).replace(
        f'address = "{testbed.hosts[1].address}"',
        f'address = "10.213.{k}.99"\nssh_host = "{testbed.hosts[1].address}"',
    )
    (tmp_path / "dtrain.toml").write_text(toml)
    bad = subprocess.run(
        [*CLI, "doctor", "--cluster", "bad", "--mib", "1"],
        cwd=tmp_path,
        env=cli_env(tmp_path, emulator),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert bad.returncode == ExitCode.FAILURE, bad.stdout + bad.stderr
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    wanted = (
        rf"error: \d+ check\(s\) failed: first: node h1, interface: no interface holds its address 10\.213\.{k}\.99; "
        rf"its hostname {re.escape(os.uname().nodename)} resolves to 127\.0\.1\.1"
    )
    assert len(errors) == 1 and re.fullmatch(wanted, errors[0]), bad.stderr


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_node_logs_reach_the_run_while_it_trains_and_logs_f_follows_them(
    cwd: Path, emulator: str, testbed: Testbed
) -> None:
    """Each node's lines reach the run's logs/ in the bucket while the job runs (epoch 1's and 2's results are
    there before the job ends); `dtrain logs RUN -f` prints them as they come and returns when the job has
    ended. How soon they arrive (remote.LogFiles syncs every 2 s) is not asserted here: a time limit in a
    test on a shared 2-core machine says more about the machine than about the code."""
    import datetime

    out = bucket(emulator)
    args = [*MNIST[: MNIST.index("--epochs")], "--epochs", "3", "--train-split", "train[:4096]",
            "--batch-size", "256", "--nproc", "1", "--output", out]  # fmt: skip
    job = start(cwd, emulator, *args)
    follower = None
    try:
        store = open_store(out)
        run_id = wait_for_value(lambda: next(iter({n.split("/")[0] for n in store.list("")}), None), job, 120)
        run = store.child(run_id)
        follower = start(cwd, emulator, "logs", run_id, "--output", out, "-f")
        created = wait_for_value(lambda: (read_json(run, "config.json") or {}).get("created"), job, 120)
        lags: dict[str, float] = {}
        seen = 0
        while job.poll() is None:
            try:
                text = run.read_bytes("logs/h0.log").decode()
            except FileNotFoundError:
                text = ""
            now = datetime.datetime.now(datetime.timezone.utc).timestamp()
            for ln in text.splitlines()[seen:]:
                stamp, _, line = ln.partition(" ")
                lags[line] = now - max(datetime.datetime.fromisoformat(stamp).timestamp(), created)
            seen = len(text.splitlines())
            time.sleep(0.25)
        assert job.returncode == 0, job.stdout.read()
        during = [line for line in lags if "eval accuracy" in line and not line.startswith("epoch 3/3")]
        assert during, lags  # epoch 1's and 2's results arrived while the job still ran
        followed, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0, followed
        lines = followed.splitlines()
        epochs = [ln.split(":")[0] for ln in lines if ln.startswith("[h0] epoch ") and "eval accuracy" in ln]
        assert epochs == ["[h0] epoch 1/3", "[h0] epoch 2/3", "[h0] epoch 3/3"], followed
        assert {ln.split("]")[0] for ln in lines if ln.startswith("[h")} == {"[h0", "[h1"}
        assert sorted(lines[-2:]) == ["[h0] dtrain: job ended (exit 0)", "[h1] dtrain: job ended (exit 0)"], lines
    finally:
        for p in (job, follower):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def wait_for_value(fn, proc: subprocess.Popen, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"nothing after {timeout} s")
