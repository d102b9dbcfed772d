"""Queued jobs on a real Slurm in the network-namespace test bed (tests/slurm/conftest.py): dtrain sets Slurm
up on bare hosts, jobs queue FIFO, survive a crashed node and a restarted slurmctld, are cancelled with
their checkpoint kept, and are followed live; the same Slurm is driven through a login node as a user's
own cluster; bad inputs are one line each and lose nothing.

Needs root (network namespaces; CI runs as root), Debian's slurm-wlm and munge, and dataset-fashion-mnist.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtrain.common.errors import ExitCode

from .conftest import BATCH, EPOCHS, SHORT, TOTAL_STEPS, Env

pytestmark = pytest.mark.root


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one `error:` line on stderr, after checking there is exactly one and no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def job_processes(env: Env, job: str | None = None) -> dict[str, list[str]]:
    """Each host's processes of dtrain jobs (batch step, node tasks, agents, torchrun, workers); with `job`, only
    that job's (SLURM_JOB_ID in their environment: Slurm sets it for everything a job starts)."""
    out: dict[str, list[str]] = {}
    for h in env.sb.hosts:
        found = []
        for pid in env.sb.bed.pids(h):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if job is not None and f"SLURM_JOB_ID={job}".encode() not in (
                    Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                ):
                    continue
            except OSError:
                continue
            if "dtrain." in cmd:
                found.append(cmd)
        out[h.name] = found
    return out


def latest(run: Path | str) -> int:
    """The step of the run's last complete checkpoint (a folder or a gs:// URL), 0 before the first: read as
    dtrain reads it (dtrain.common.rundir.checkpoints: the nodes' copies under ckpt/, or checkpoints/ in place)."""
    from dtrain.common.rundir import checkpoints, find_latest
    from dtrain.common.storage import open_store

    found = find_latest(checkpoints(open_store(str(run))))
    return found.step if found else 0


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


# ---------------------------------------------------------------------------------------------
# setup and bad inputs (no training)


def test_dtrain_sets_slurm_up_on_bare_hosts(bed: Env) -> None:
    """The fixture ran `dtrain slurm setup` on hosts that only had the packages: one key, one slurm.conf
    everywhere, daemons up. Running it again changes nothing; doctor checks munge and Slurm on every node."""
    sb = bed.sb
    assert "h0: wrote munge.key, slurm.conf, cgroup.conf" in bed.setup_output, bed.setup_output
    assert "Slurm: 2 node(s) registered with slurmctld on h0" in bed.setup_output
    key = bed.cwd / "config" / "dtrain" / "clusters" / "bed" / "munge.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_bytes()) == 1024
    confs = {h: sb.private(sb.host(h), "/etc/slurm/slurm.conf").read_text() for h in ("h0", "h1")}
    assert confs["h0"] == confs["h1"]
    assert re.search(r"^NodeName=h1 NodeHostname=h1 NodeAddr=10\.213\.\d+\.12 CPUs=", confs["h0"], re.M), confs["h0"]
    for h in ("h0", "h1"):
        node_key = sb.private(sb.host(h), "/etc/munge/munge.key")
        assert node_key.read_bytes() == key.read_bytes()
        assert oct(node_key.stat().st_mode & 0o777) == "0o400"
    assert key.read_bytes().hex() not in bed.setup_output  # the key travels on SSH's stdin only
    again = bed.dtrain("slurm", "setup", "--cluster", "bed")
    assert again.returncode == 0 and "wrote" not in again.stdout, again.stdout + again.stderr
    doc = bed.dtrain("doctor", "--cluster", "bed", "--mib", "1")
    assert doc.returncode == 0, doc.stdout + doc.stderr
    text = " ".join(doc.stdout.split())
    for h in ("h0", "h1"):
        assert f"{h} │ munge │ ok │ decodes h0's credential" in text and f"{h} │ slurmd │ ok │ idle" in text, text
    assert "Slurmctld(primary) at h0 is UP" in text


def test_bad_inputs_are_one_line_and_lose_nothing(bed: Env) -> None:
    sb = bed.sb
    before = bed.jobs("bed")
    toml = (bed.cwd / "dtrain.toml").read_text()
    toml += "\n" + sb.slurm_toml("nopart", "python3", login=sb.host("h2"), workdir=sb.shared / "user",
                                 extra='partition = "nope"')  # fmt: skip
    (bed.cwd / "dtrain.toml").write_text(toml)
    short = ["mnist", "--dataset", "fashion-mnist", "--epochs", "1", "--output", str(bed.runs)]

    r = bed.dtrain("submit", *short, "--cluster", "nopart")
    assert r.returncode == ExitCode.USAGE
    assert error_line(r) == "error: cluster nopart has no Slurm partition 'nope' (partitions: dtrain)"

    r = bed.dtrain("submit", *short, "--cluster", "bed", "--nodes", "3")
    assert r.returncode == ExitCode.USAGE
    assert error_line(r) == (
        "error: --nodes 3 is more nodes than partition dtrain of cluster bed has (2): use --nodes 2 or fewer"
    )

    sb.hide_slurm(sb.host("h2"))  # the login node without Slurm's commands
    try:
        r = bed.dtrain("submit", *short, "--cluster", "user")
    finally:
        sb.hide_slurm(sb.host("h2"), hidden=False)
    assert r.returncode == ExitCode.USAGE
    assert re.fullmatch(
        r"error: the login node root@10\.213\.\d+\.13 has no `(sinfo|sbatch)`: dtrain needs Slurm's client commands "
        r"there \(sbatch, squeue, scontrol, scancel, sacct\): point login at a Slurm login node, or install "
        r"slurm-client on it",
        error_line(r),
    ), r.stderr

    for command in (["cancel", "99999"], ["logs", "99999"]):
        r = bed.dtrain(*command, "--cluster", "bed")
        assert r.returncode == ExitCode.USAGE
        assert error_line(r).startswith("error: no job 99999 on cluster bed: `dtrain jobs --cluster bed --all`")
    r = bed.dtrain("cancel", "12x", "--cluster", "bed")
    assert error_line(r) == "error: '12x' is not a Slurm job id (digits, as `dtrain submit` printed it)"

    assert bed.jobs("bed") == before  # nothing was queued, nothing changed
    assert not any(bed.runs.glob("*/config.json")) or all(  # and no run was started by a refused submit
        (p.parent / "status.json").exists() for p in bed.runs.glob("*/config.json")
    )


@pytest.mark.slow
def test_munge_key_mismatch_on_one_node(bed: Env) -> None:
    """h1's munged gets another key: doctor names it in one line; a job submitted meanwhile waits (nothing
    lost) and runs once `dtrain slurm setup` has put the cluster's key back."""
    sb = bed.sb
    h1 = sb.host("h1")
    key = sb.private(h1, "/etc/munge/munge.key")
    key.chmod(0o600)
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    sb.ssh(h1, 'kill "$(cat /run/munge/munged.pid)"; sleep 0.5; runuser -u munge -- /usr/sbin/munged')
    fixed = False
    try:
        doc = bed.dtrain("doctor", "--cluster", "bed", "--mib", "1")
        assert doc.returncode == ExitCode.FAILURE, doc.stdout + doc.stderr
        assert re.fullmatch(
            r"error: \d+ check\(s\) failed: first: node h1, munge: its munge key differs from h0's \(.*\)",
            error_line(doc),
        ), doc.stderr
        # slurmctld no longer hears h1 (its messages fail authentication): it marks it not responding.
        deadline = time.monotonic() + 120
        while "h1 │ slurmd │ FAIL" not in " ".join(
            bed.dtrain("doctor", "--cluster", "bed", "--mib", "1").stdout.split()
        ):
            assert time.monotonic() < deadline, "slurmctld never marked h1 not responding"
            time.sleep(3)
        r = bed.dtrain("submit", "mnist", "--cluster", "bed", "--dataset", "fashion-mnist", "--epochs", "1",
                       "--train-split", "train[:2000]", "--nproc", "1", "--output", str(bed.runs))  # fmt: skip
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip()
        assert job.isdigit(), r.stdout
        warnings = [ln for ln in r.stderr.splitlines() if "node h1 is" in ln]
        assert len(warnings) == 1 and "`dtrain doctor --cluster bed` says why" in warnings[0], r.stderr
        assert bed.jobs()[job]["state"] == "PENDING"
        fix = bed.dtrain("slurm", "setup", "--cluster", "bed", timeout=300)
        fixed = fix.returncode == 0
        assert fixed and "h1: wrote munge.key" in fix.stdout, fix.stdout + fix.stderr
        row = bed.wait(job, lambda j: j["state"] not in ("PENDING", "RUNNING", "COMPLETING"), what="its end")
        assert row["state"] == "COMPLETED", row
    finally:
        if not fixed:  # the other tests need h1
            bed.dtrain("slurm", "setup", "--cluster", "bed", timeout=300)


# ---------------------------------------------------------------------------------------------
# jobs that train


@pytest.mark.slow
def test_three_jobs_run_in_turn_cancel_keeps_a_checkpoint(bed: Env) -> None:
    """Three 2-node jobs on the 2-node cluster: FIFO, one RUNNING and two PENDING; slurmctld restarts under
    them; the middle one is cancelled while it trains (CANCELLED, its checkpoint kept); the others complete
    every step they were given.

    What is proven here is the queue, the restart and the cancel, not the accuracy bar: the first and last jobs
    train one epoch of 16,000 and of 4,000 images with a 2,000-image evaluation (they learn: over 0.5), and
    test_a_users_slurm_cluster_through_its_login_node trains the cluster tests' 2 x 16,000 images to 0.80. The
    first job's 62 steps keep it RUNNING through slurmctld's restart; the middle job has the 124 steps of the
    cluster tests and is cancelled at its first checkpoint (step 10), so it is still training when the cancel
    lands."""
    sizes = [["--epochs", "1", "--eval-split", "test[:2000]"], [],
             ["--epochs", "1", "--train-split", "train[:4000]", "--eval-split", "test[:2000]"]]  # fmt: skip
    steps = [TOTAL_STEPS // EPOCHS, TOTAL_STEPS, 4000 // BATCH]
    jobs = [bed.submit("--checkpoint-every", "10", "--name", f"lr-{i}", *sizes[i]) for i in range(3)]
    assert [int(j) for j in jobs] == sorted(int(j) for j in jobs)
    bed.wait(jobs[0], lambda j: j["state"] == "RUNNING", what="RUNNING")
    rows = bed.jobs()
    assert [rows[j]["state"] for j in jobs] == ["RUNNING", "PENDING", "PENDING"], rows
    assert [rows[j]["name"] for j in jobs] == ["lr-0", "lr-1", "lr-2"]
    assert rows[jobs[1]]["reason"] in ("Resources", "Priority") and rows[jobs[2]]["reason"] in ("Resources", "Priority")

    bed.sb.restart_slurmctld(bed.sb.host("h0"))  # queued and running jobs survive it
    rows = bed.jobs()
    assert [rows[j]["state"] for j in jobs] == ["RUNNING", "PENDING", "PENDING"], rows

    first = bed.wait(jobs[0], lambda j: j["state"] == "COMPLETED", what="COMPLETED")
    assert first["exit_code"] == 0 and first["restarts"] == 0
    middle = bed.wait(jobs[1], lambda j: j["state"] == "RUNNING", what="RUNNING")
    run = Path(middle["url"])
    deadline = time.monotonic() + 300
    while latest(run) < 10:
        assert time.monotonic() < deadline, "the middle job saved no checkpoint"
        time.sleep(0.5)
    r = bed.dtrain("cancel", jobs[1], "--cluster", "bed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(
        rf"job {jobs[1]} CANCELLED \(was RUNNING\); run \S+: its last checkpoint step-\d+ is kept", r.stdout
    )
    cancelled = bed.jobs()[jobs[1]]
    assert cancelled["state"] == "CANCELLED", cancelled
    assert status(run)["state"] == "preempted" and latest(run) >= 10  # the ranks checkpointed on SIGTERM
    again = bed.dtrain("cancel", jobs[1], "--cluster", "bed")
    assert again.returncode == ExitCode.USAGE
    assert error_line(again).startswith(f"error: job {jobs[1]} has already ended (CANCELLED")

    last = bed.wait(jobs[2], lambda j: j["state"] == "COMPLETED", what="COMPLETED")
    for row, want in ((first, steps[0]), (last, steps[2])):
        final = status(Path(row["url"]))["result"]
        assert final["accuracy"] >= 0.5 and final["steps"] == want and final["world_size"] == 2, final
        assert row["last_metric"]["step"] == want
    done = bed.dtrain("cancel", jobs[0], "--cluster", "bed")
    assert done.returncode == ExitCode.USAGE and "has already ended (COMPLETED" in error_line(done)
    assert job_processes(bed) == {"h0": [], "h1": [], "h2": []}


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.slow
def test_a_crashed_node_requeues_the_job_which_resumes_exactly(bed: Env, uninterrupted: dict) -> None:
    """Every process of h1 is killed mid-job, then h1 comes back: the job is requeued, resumes the same run
    from its last checkpoint and ends with the weights of an uninterrupted run; `dtrain jobs` shows 1 restart."""
    ref = uninterrupted
    job = bed.submit(*SHORT)
    row = bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    run = Path(row["url"])
    deadline = time.monotonic() + 300
    while latest(run) < 8:
        assert time.monotonic() < deadline, "no checkpoint at step 8"
        time.sleep(0.2)
    h1 = bed.sb.host("h1")
    bed.sb.crash(h1)
    bed.sb.revive(h1)
    row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the crash")
    assert row["restarts"] == 1 and row["run_id"] == run.name, row
    config = json.loads((run / "config.json").read_text())
    assert len(config.get("resumes", [])) == 1  # the same run, resumed once
    out = bed.dtrain("logs", job, "--cluster", "bed")
    resumed = [int(m) for m in re.findall(r"resuming from \S+ \(step (\d+)\)", out.stdout)]
    assert len(resumed) == 1 and resumed[0] >= 8, out.stdout
    want, got = final_weights(Path(ref["url"])), final_weights(run)
    assert max((want[k].float() - got[k].float()).abs().max().item() for k in want) <= 1e-6
    assert status(run)["result"]["steps"] == status(Path(ref["url"]))["result"]["steps"]
    assert job_processes(bed) == {"h0": [], "h1": [], "h2": []}


@pytest.mark.slow
def test_logs_follow_shows_a_line_within_two_seconds(bed: Env) -> None:
    """`dtrain logs JOB -f`: each line a rank writes shows within 2 s. A line's time of writing is the stamp
    the node's task put on it as it read it from the rank (its log file on that node)."""
    job = bed.submit("--epochs", "1", "--train-split", "train[:6000]", "--log-every", "2")
    bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    started = time.time()
    p = bed.start("logs", job, "--cluster", "bed", "-f")
    seen: list[tuple[float, str]] = []

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            seen.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=10)
    assert p.returncode == 0, p.stderr.read()  # type: ignore[union-attr]
    run = Path(bed.jobs()[job]["url"])
    stamps = {}
    for h in ("h0", "h1"):
        log = bed.sb.private(bed.sb.host(h), f"/var/lib/slurm/dtrain/runs/{run.name}/logs/{h}.log")
        for line in log.read_text().splitlines():
            stamp, _, text = line.partition(" ")
            stamps[f"[{h}] {text}"] = _epoch(stamp)
    live = [(t - stamps[line], line) for t, line in seen if line in stamps and stamps[line] > started]
    assert len(live) >= 5, seen  # lines written while following, not replayed
    slowest = max(live)
    assert slowest[0] <= 2.0, slowest


def _epoch(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp).timestamp()


@pytest.mark.slow
def test_train_through_slurm_is_live_and_ctrl_c_stops_it(bed: Env) -> None:
    """`dtrain train --cluster bed` goes through Slurm's queue: live output prefixed with the node, the job's
    exit code; Ctrl-C stops it on every node and exits 130."""
    args = ["train", "mnist", "--cluster", "bed", "--dataset", "fashion-mnist", "--epochs", "1",
            "--train-split", "train[:2000]", "--nproc", "1", "--output", str(bed.runs)]  # fmt: skip
    r = bed.dtrain(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"through Slurm: job (\d+), 2 node\(s\) in partition dtrain", r.stdout), r.stdout
    assert "[h0] epoch 1/1: eval accuracy" in r.stdout and "[h1] dtrain: new on h1" in r.stdout
    p = bed.start(*[a if a != "train[:2000]" else "train[:16000]" for a in args], session=True)
    try:
        deadline = time.monotonic() + 300
        while not all(job_processes(bed)[h] for h in ("h0", "h1")):
            assert time.monotonic() < deadline and p.poll() is None, "the job never started"
            time.sleep(0.5)
        time.sleep(5)
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to dtrain and every process it started
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == ExitCode.INTERRUPTED, out + err
    assert "interrupted: stopping the job on every node" in out
    deadline = time.monotonic() + 90
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)


@pytest.mark.slow
def test_a_users_slurm_cluster_through_its_login_node(bed: Env) -> None:
    """backend = "slurm" pointed at the same Slurm through login node h2 (configuration and key only, no
    slurmd): the job runs on the nodes Slurm picks, its files on the shared filesystem."""
    doc = bed.dtrain("doctor", "--cluster", "user")
    assert doc.returncode == 0, doc.stdout + doc.stderr
    text = " ".join(doc.stdout.split())
    assert "login │ munge │ ok" in text and "h1 │ slurmd │ ok" in text, text
    job = bed.submit("--nodes", "2", cluster="user")
    row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED", cluster="user")
    assert row["nodes"] == 2 and row["nodelist"] == "h[0-1]"
    final = status(Path(row["url"]))["result"]
    assert final["accuracy"] >= 0.80 and final["world_size"] == 2, final
    job_dir = bed.sb.shared / "user" / "runs" / row["run_id"]
    assert sorted(p.name for p in (job_dir / "logs").iterdir()) == ["h0.log", "h1.log"]
    assert (job_dir / f"slurm-{job}.out").is_file()
    logs = bed.dtrain("logs", job, "--cluster", "user")
    assert "[h0] epoch 2/2: eval accuracy" in logs.stdout and "[h1] dtrain: new on h1" in logs.stdout
    by_run = bed.dtrain("logs", row["run_id"], "--output", str(bed.runs))  # the run keeps a copy of them
    assert by_run.returncode == 0 and "[h0] epoch 2/2: eval accuracy" in by_run.stdout, by_run.stderr


@pytest.mark.slow
def test_a_cluster_that_grew_is_reconfigured_under_a_running_job(bed: Env) -> None:
    """A third node joins the inventory (as `dtrain up` with more workers does on gcp): setup rewrites
    slurm.conf on every node and restarts the daemons; the job running meanwhile goes on and completes."""
    sb = bed.sb
    job = bed.submit("--epochs", "1", "--train-split", "train[:6000]")
    bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    toml = (bed.cwd / "dtrain.toml").read_text()
    two, three = sb.hosts_toml("bed", sys.executable, nodes=2), sb.hosts_toml("bed", sys.executable, nodes=3)
    assert two in toml
    (bed.cwd / "dtrain.toml").write_text(toml.replace(two, three))
    r = bed.dtrain("slurm", "setup", "--cluster", "bed", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "h2: wrote" in r.stdout and "h0: wrote slurm.conf" in r.stdout, r.stdout
    assert "Slurm: 3 node(s) registered with slurmctld on h0" in r.stdout
    assert bed.jobs()[job]["state"] == "RUNNING"
    row = bed.wait(job, lambda j: j["state"] not in ("RUNNING", "COMPLETING"), what="its end")
    assert row["state"] == "COMPLETED" and row["restarts"] == 0, row
    doc = bed.dtrain("doctor", "--cluster", "bed", "--mib", "1")
    assert "h2 │ slurmd │ ok" in " ".join(doc.stdout.split()), doc.stdout


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_a_job_whose_ranks_stop_making_progress_is_shown_stalled(bed: Env) -> None:
    """The job's training processes are frozen (SIGSTOP) while Slurm still has it RUNNING: once its
    metrics.jsonl has not advanced for the table's stall_after (5 s here), `dtrain jobs` says stalled, with
    since when; node-hours are counted and the cost is "-" (no price for the user's own machines)."""
    text = (bed.cwd / "dtrain.toml").read_text()
    assert text.startswith("[clusters.bed]\n")
    stall_toml = bed.cwd / "stall.toml"
    stall_toml.write_text(text.replace("[clusters.bed]\n", '[clusters.bed]\nstall_after = "5s"\n', 1))
    # Two nodes: the cluster may have grown to three (the test before this one), and 256 is not divisible by 3.
    job = bed.submit("--epochs", "4", "--name", "stall", "--nodes", "2")
    row = bed.wait(job, lambda j: j["state"] == "RUNNING" and j["last_metric"].get("step"), what="a metrics line")
    run = Path(row["url"])
    frozen = []
    for h in bed.sb.hosts:  # wherever Slurm placed its two nodes
        for pid in bed.sb.bed.pids(h):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "dtrain.mnist.train" in cmd and "dtrain.common.launch" not in cmd:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
    assert len(frozen) == 2, frozen  # one rank on each node
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        deadline = time.monotonic() + 120
        while True:
            r = bed.dtrain("--config", str(stall_toml), "jobs", "--cluster", "bed", "--json")
            assert r.returncode == 0, r.stderr
            stalled = {j["job_id"]: j for j in json.loads(r.stdout)}[job]
            if stalled["stalled"]:
                break
            assert time.monotonic() < deadline, f"not shown stalled: {stalled}"
            time.sleep(1)
        assert stalled["state"] == "RUNNING" and stalled["stalled_since"]
        assert (run / "metrics.jsonl").read_text().splitlines() == lines  # nothing advanced meanwhile
        last = json.loads(lines[-1])
        since = time.mktime(time.strptime(stalled["stalled_since"], "%Y-%m-%dT%H:%M:%S"))
        assert int(last["time"]) <= since + 1  # at or after its last line (the job's start, if later)
        assert stalled["node_hours"] > 0 and stalled["usd"] is None
        r = bed.dtrain("--config", str(stall_toml), "jobs", "--cluster", "bed")
        assert r.returncode == 0 and f"stalled since {stalled['stalled_since'].replace('T', ' ')}" in r.stdout, r.stdout
        # Without the 5 s table key the default is 30 minutes: the same job is not stalled.
        assert bed.jobs()[job]["stalled"] is False
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    r = bed.dtrain("cancel", job, "--cluster", "bed")
    assert r.returncode == 0, r.stdout + r.stderr
