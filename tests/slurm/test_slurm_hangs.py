"""Hang detection that acts, on the real Slurm bed (tests/slurm/conftest.py; docs/hangs.md, "Slurm"): a worker of
a 2-node Fashion-MNIST job submitted with `--max-restarts 1` is frozen with SIGSTOP (what a GPU, NCCL or
filesystem hang looks like from outside). Its node agent finds it and dumps its stacks; the batch step writes them
into the run, says one line, records a `hang` event, stops every node's step and requeues the job, which resumes
the run from its last complete checkpoint and completes. Prints the issue's figures: freeze to detection, and
freeze to training again. Real slurmctld, slurmd, sbatch/srun, torchrun and gloo.

Needs root (network namespaces; CI runs as root), Debian's slurm-wlm and munge.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from runs import CLI, stop_labels

from dtrain.common import progress

from .conftest import TOTAL_STEPS, Env
from .test_slurm_bed import job_processes, latest
from .test_slurm_programs import FAST

pytestmark = [pytest.mark.root, pytest.mark.slow]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def workers(bed: Env, host: str, module: str) -> list[int]:
    """The training processes (torchrun's workers) on `host`: their command line names `module`, not dtrain's
    own launcher or agent."""
    found = []
    for pid in bed.sb.bed.pids(bed.sb.host(host)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if module in cmd and "dtrain.common." not in cmd and "torchrun" not in cmd:
            found.append(pid)
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := predicate():
            return got
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def freeze_a_worker(bed: Env, job: str, run: Path, *, module: str, after_ckpt: int) -> tuple[int, str, float, int]:
    """Once the run has a checkpoint at step >= after_ckpt: SIGSTOP a worker on h1. (pid, its rank, when, the
    checkpoint's step)."""
    ckpt = wait_for(lambda: latest(run) >= after_ckpt and latest(run), 150, f"job {job}: a checkpoint")
    pids = wait_for(lambda: workers(bed, "h1", module), 60, f"job {job}: a worker on h1")
    pid = pids[0]
    rank = progress._rank_of(pid)
    assert rank is not None, pid
    os.kill(pid, signal.SIGSTOP)
    return pid, str(rank), time.time(), ckpt


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_frozen_worker_is_found_named_stopped_and_the_job_requeued_resumes(bed: Env) -> None:
    # Two nodes: the package's bed may have grown to three (test_slurm_bed), and 256 is not divisible by 3.
    # One epoch: a checkpoint at step 20, the freeze, the 30 s floor, the requeue and the rest fit in 300 s.
    job = bed.submit("--checkpoint-every", "20", "--max-restarts", "1", "--epochs", "1", "--nodes", "2",
                     "--eval-split", "test[:2000]")  # fmt: skip
    total = TOTAL_STEPS // 2  # 62 steps an epoch
    run = bed.run_dir(job)
    pid = 0
    try:
        pid, rank, frozen_at, ckpt = freeze_a_worker(bed, job, run, module="dtrain.mnist.train", after_ckpt=20)
        row = bed.wait(job, lambda j: j["state"] == "COMPLETED", timeout=240, what="COMPLETED after the hang")
    finally:
        if pid:
            thaw(pid)
    assert row["restarts"] >= 1 and row["hang_restarts"] == 1, row
    events = rows(run / "events.jsonl")
    hangs = [e for e in events if e["event"] == "hang"]
    assert len(hangs) == 1, hangs
    assert stop_labels(events) == ["hang"], events  # one label for the stop: not rank 0's `preempted` too
    hang = hangs[0]
    assert hang["node"] == "h1" and str(hang["rank"]) == rank and hang["timeout_s"] == progress.FLOOR_S, hang
    assert hang["stacks"] == f"{run}/hangs/h1-rank{rank}.txt", hang
    stack = (run / "hangs" / f"h1-rank{rank}.txt").read_text()
    assert "mnist/train.py" in stack, stack  # where the frozen rank was: in the training loop
    # One line naming the host, the rank, its last step and the stack file, in the job's logs.
    out = bed.dtrain("logs", job, "--cluster", "bed").stdout
    lines = [ln for ln in out.splitlines() if "dtrain: hang on " in ln]
    assert len(lines) == 1, out[-3000:]
    assert f"dtrain: hang on h1 rank {rank}: no progress for " in lines[0], lines
    assert f"since step {hang['step']}; stacks in {run}/hangs/h1-rank{rank}.txt" in lines[0], lines
    assert "the job hung: requeued; it resumes from its last complete checkpoint (restart 1 of 1)" in out, out[-3000:]
    # Resumed from the last complete checkpoint, trained again, completed.
    resumed = [e for e in events if e["event"] == "resumed" and e["time"] > hang["time"]]
    assert resumed and resumed[0]["step"] >= ckpt, events
    again = [m for m in rows(run / "metrics.jsonl") if m["time"] > resumed[0]["time"] and "loss" in m]
    assert again, "no training metrics after the requeue"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["result"]["steps"] == total, status
    detected, training = hang["time"] - frozen_at, again[0]["time"] - frozen_at
    print(f"job {job}: worker of h1 rank {rank} frozen at step ~{hang['step']} (checkpoint {ckpt}); hang found "
          f"{detected:.1f} s after the freeze, training again (first metrics row after the requeue, from step "
          f"{resumed[0]['step']}) {training:.1f} s after it")  # fmt: skip
    # Never before the automatic timeout's 30 s floor, counted from the rank's last heartbeat (at most a second
    # before the freeze); the latency itself is a printed figure.
    assert detected >= 29, detected
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)


def test_a_hang_past_the_restarts_ends_the_job_and_the_run_says_it_hung(bed: Env) -> None:
    """--max-restarts 0 (the default) and --hang-timeout 12: found after 12 s, the job ends with exit 4 and is not
    requeued; the run's status.json says it hung."""
    job = bed.submit("--checkpoint-every", "20", "--hang-timeout", "12", "--epochs", "3", "--nodes", "2")
    run = bed.run_dir(job)
    pid = 0
    try:
        pid, rank, frozen_at, _ = freeze_a_worker(bed, job, run, module="dtrain.mnist.train", after_ckpt=20)
        row = bed.wait(job, lambda j: j["state"] == "FAILED", timeout=200, what="FAILED after the hang")
    finally:
        if pid:
            thaw(pid)
    assert row["exit_code"] == 4 and row["restarts"] == 0 and row["hang_restarts"] == 0, row
    (hang,) = [e for e in rows(run / "events.jsonl") if e["event"] == "hang"]
    # Its age counts from the rank's last heartbeat (at most a second before the freeze).
    assert hang["timeout_s"] == 12.0 and hang["time"] - frozen_at >= 10, (hang, frozen_at)  # not before its timeout
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 4, status
    assert status["error"].startswith("hung: no progress for ") and f" on h1 rank {rank} since step " in status["error"]
    assert status["error"].endswith(f"/hangs/h1-rank{rank}.txt"), status  # the stacks' file in the run
    out = bed.dtrain("logs", job, "--cluster", "bed").stdout
    assert "the job hung and ends (exit 4), not requeued: --max-restarts is 0" in out, out[-3000:]
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)


# A user's torchrun script with the SDK (no collectives: each rank keeps its own pace) and a checkpoint of its own
# in the checkpoint directory (rank 0's step), which dtrain copies into the run and puts back when the job runs
# again. Rank 1 takes twice as long a step (a straggler) and has half the steps: the ranks end together (a rank
# left alone once its peer's torchrun has ended is at the mercy of torch's elastic agent). 60 s of steps: the
# straggler is shown and rank 1 frozen within its first 20 s, and rank 0 is still at work when the hang is found
# (--hang-timeout 15; the automatic timeout's 30 s floor is the frozen mnist worker's test, above).
SDK_SCRIPT = """\
import json
import os
import time

from dtrain import sdk

STEPS = 600


def train_step(rank):
    time.sleep(0.2 if rank == 1 else 0.1)


def main():
    rank = int(os.environ["RANK"])
    path = os.path.join("checkpoints", "step.json")
    start = json.load(open(path))["step"] if os.path.exists(path) else 0
    steps, start = (STEPS, start) if rank == 0 else (STEPS // 2, start // 2)
    if start:
        print(f"rank {rank} resumed at step {start}", flush=True)
    for step in range(start + 1, steps + 1):
        train_step(rank)
        sdk.log(step, loss=1.0 / step)
        if rank == 0 and step % 20 == 0:
            os.makedirs("checkpoints", exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(path + ".tmp", path)
    print(f"rank {rank} done", flush=True)


main()
"""


def test_a_users_sdk_script_shows_its_straggler_and_resumes_after_a_hang(bed: Env, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "sdk_train.py").write_text(SDK_SCRIPT)
    argv = ["submit", "sdk_train.py", "--cluster", "bed", "--nodes", "2", "--nproc", "1", "--max-restarts", "1",
            "--hang-timeout", "15", "--output", str(bed.runs), "--workdir", str(project),
            "--checkpoint-dir", "checkpoints"]  # fmt: skip
    r = subprocess.run([*CLI, *argv], cwd=bed.cwd, env={**bed.env(), **FAST}, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stdout + r.stderr
    job = r.stdout.strip()
    # The straggler, in `dtrain jobs` while the job runs.
    row = bed.wait(job, lambda j: j.get("stragglers"), timeout=120, what="a straggler in dtrain jobs")
    assert row["stragglers"].startswith("h1 rank 1 (") and row["stragglers"].endswith("x)"), row
    run = Path(row["url"])
    pid = 0
    try:
        pids = wait_for(lambda: [p for p in workers(bed, "h1", "sdk_train.py") if progress._rank_of(p) == "1"], 60,
                        "rank 1 on h1")  # fmt: skip
        pid = pids[0]
        wait_for(lambda: (run / "ckpt").exists(), 60, "the checkpoint directory's copy in the run")
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            row = bed.wait(job, lambda j: j["state"] == "COMPLETED", timeout=200, what="COMPLETED after the hang")
        except BaseException:
            for f in sorted((run / "hangs").glob("*.txt")):
                print(f"--- {f.name}\n{f.read_text()[-3000:]}")
            print("\n".join(json.dumps(e) for e in rows(run / "events.jsonl")))
            raise
    finally:
        if pid:
            thaw(pid)
    assert row["hang_restarts"] == 1 and row["restarts"] >= 1, row
    events = rows(run / "events.jsonl")
    strag = [e for e in events if e["event"] == "straggler"]
    assert strag and set(strag[0]["stragglers"]) == {"h1 rank 1"} and strag[0]["stragglers"]["h1 rank 1"] > 1.5, strag
    (hang,) = [e for e in events if e["event"] == "hang"]
    assert hang["node"] == "h1" and str(hang["rank"]) == "1", hang
    assert "sdk_train.py" in (run / "hangs" / "h1-rank1.txt").read_text()  # the frozen rank's own stack
    out = bed.dtrain("logs", job, "--cluster", "bed").stdout
    assert len([ln for ln in out.splitlines() if "dtrain: hang on h1 rank 1: " in ln]) == 1, out[-3000:]
    assert "rank 1 resumed at step " in out and "rank 1 done" in out, out[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2, status
    metrics = [m for m in rows(run / "metrics.jsonl") if m.get("time", 0) > hang["time"]]
    print(f"program job {job}: straggler {row['stragglers'] or strag[0]['stragglers']}; hang found "
          f"{hang['time'] - frozen_at:.1f} s after the freeze"
          + (f", rank 0 logging again {metrics[0]['time'] - frozen_at:.1f} s after it" if metrics else ""))  # fmt: skip
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)
