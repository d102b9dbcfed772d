"""End-to-end MNIST runs through the real CLI and torchrun (gloo, real processes) on a slice of
Fashion-MNIST: DDP equivalence, kill -9 and resume, a kill during a save, SIGTERM, gs:// runs,
and a hung peer. Assertions are on numbers: losses, steps, weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import runs
import torch
from runs import (
    RUN_FILES,
    assert_no_workers_left,
    bucket_checkpoints,
    env,
    latest_step,
    metrics,
    only_run,
    only_run_in_bucket,
    peers,
    run_dir_of,
    wait_for,
)
from safetensors.torch import load_file

from dtrain.common.env import cache_dir
from dtrain.common.rundir import checkpoints
from dtrain.common.storage import open_store

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(
    not (FASHION / "train-images-idx3-ubyte.gz").exists(),
    reason="needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)",
)
# 4096 images, batch 64: 64 steps an epoch, logged and checkpointed every 16 steps.
SMALL = [
    "--dataset",
    "fashion-mnist",
    "--train-split",
    "train[:4096]",
    "--eval-split",
    "test[:2000]",
    "--batch-size",
    "64",
    "--checkpoint-every",
    "16",
]
LOG_EVERY = {"DTRAIN_LOG_EVERY": "16"}


def dtrain(args: list[str], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    return runs.dtrain(args, cwd, **LOG_EVERY, **extra_env)


def start(args: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen:
    return runs.start(args, cwd, **LOG_EVERY, **extra_env)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}


def start_run(cwd: Path, pause_s: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """Start a two-epoch run whose checkpoint writes each pause `pause_s` (fault injection that
    changes no number) so it is slow enough to be caught mid-way; returns it and its directory."""
    proc = start(
        ["train", "mnist", *SMALL, "--epochs", "2", "--nproc", "2", "--output", "runs", *args],
        cwd,
        DTRAIN_INTERNAL_FAULT_PAUSE_BEFORE_COMMIT=pause_s,
    )
    return proc, run_dir_of(cwd, proc)


def resume_equals_reference(
    cwd: Path, run: Path, from_step: int, reference: Path, stopped_at: int | None = None, by_path: bool = False
):
    r = dtrain(["train", "mnist", "--resume", str(run) if by_path else run.name, "--output", "runs"], cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming from {run / 'checkpoints'}/step-{from_step:08d} (step {from_step})" in r.stdout
    assert_same_result(run, reference, stopped_at=stopped_at)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run of two epochs: what interrupted runs must reproduce."""
    cwd = tmp_path_factory.mktemp("ref")
    r = dtrain(["train", "mnist", *SMALL, "--epochs", "2", "--nproc", "2", "--output", "runs"], cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return only_run(cwd / "runs")


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def assert_same_result(run: Path, ref: Path, stopped_at: int | None = None) -> None:
    got, want = json.loads((run / "status.json").read_text()), json.loads((ref / "status.json").read_text())
    assert got["state"] == want["state"] == "completed"
    assert got["result"]["final_loss"] == pytest.approx(want["result"]["final_loss"], abs=1e-6)
    assert got["result"]["accuracy"] == want["result"]["accuracy"]
    w, r = final_weights(run), final_weights(ref)
    assert w.keys() == r.keys()
    assert max((w[k].float() - r[k].float()).abs().max().item() for k in w) <= 1e-6
    got_l, want_l = losses(run), losses(ref)
    assert got_l.keys() == want_l.keys()
    if stopped_at is not None and stopped_at % 16:
        # A stop inside a 16-step logging window: the window's loss after resume averages only the
        # steps since the resume. Every other window is the same numbers.
        window_end = stopped_at + 16 - stopped_at % 16
        got_l.pop(window_end), want_l.pop(window_end)
    assert got_l == pytest.approx(want_l, abs=1e-6)


def test_ddp_two_processes_match_one_with_the_same_global_batch(tmp_path, reference):
    r = dtrain(["train", "mnist", *SMALL, "--epochs", "2", "--nproc", "1", "--output", "runs"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    single, ddp = losses(only_run(tmp_path / "runs")), losses(reference)
    assert single.keys() == ddp.keys() and len(single) == 8
    # Converges: the last window's loss is under 60% of the first's.
    assert ddp[128] < 0.6 * ddp[16] and single[128] < 0.6 * single[16]
    # Same global batch, same data order: the same curve up to per-rank BatchNorm statistics and
    # float summation order. Stated tolerance: every logged loss within 5% (relative).
    for step in single:
        assert ddp[step] == pytest.approx(single[step], rel=0.05), step
    # Rank 0 alone reports: TensorBoard events next to metrics.jsonl, and `dtrain runs` sees the run.
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    listed = json.loads(dtrain(["runs", "--json", "--output", str(reference.parent)], tmp_path).stdout)
    best = max(r["eval_accuracy"] for r in metrics(reference) if "eval_accuracy" in r)
    assert [(r["run_id"], r["status"], r["best_value"], r["step"]) for r in listed] == [
        (reference.name, "completed", best, 128)
    ]
    acc = [
        json.loads((run / "status.json").read_text())["result"]["accuracy"]
        for run in (only_run(tmp_path / "runs"), reference)
    ]
    assert min(acc) > 0.75 and abs(acc[0] - acc[1]) < 0.02


def test_kill_9_a_rank_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    proc, run = start_run(tmp_path, "0.4")
    wait_for(lambda: latest_step(run) >= 48, proc, what="a checkpoint at step 48")
    peers_before = peers(run)
    rank1 = next(p for p in peers_before if p["rank"] == 1)
    os.kill(rank1["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    # The surviving rank names the one that died, with its host and pid.
    host = os.uname().nodename
    assert f"error: rank 0 on {host} (pid {peers_before[0]['pid']}): lost rank 1 on {host} (pid {rank1['pid']})" in out
    stopped_at = latest_step(run)
    assert 48 <= stopped_at < 128
    assert_no_workers_left([run])

    resume_equals_reference(tmp_path, run, stopped_at, reference)


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_a_save_killed_half_way_is_never_used(tmp_path, reference):
    proc, run = start_run(tmp_path, "3")

    def half_written() -> Path | None:
        ckpts = run / "checkpoints"
        if not ckpts.exists():
            return None
        for d in sorted(ckpts.glob("step-*")):
            if (d / "state.pt").exists() and not (d / "meta.json").exists() and latest_step(run) > 0:
                return d
        return None

    partial = wait_for(half_written, proc, what="a second save in flight")
    complete = latest_step(run)
    rank0 = next(p for p in peers(run) if p["rank"] == 0)
    os.kill(rank0["pid"], signal.SIGKILL)  # rank 0 is the writer
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert not (partial / "meta.json").exists()
    partial_step = int(partial.name.split("-")[1])
    assert complete < partial_step
    assert latest_step(run) == complete  # the reader skips the half-written one
    assert_no_workers_left([run])

    resume_equals_reference(tmp_path, run, complete, reference)


def test_sigterm_checkpoints_then_exits_3_and_resumes(tmp_path, reference):
    proc, run = start_run(tmp_path, "0.4")
    wait_for(lambda: latest_step(run) >= 16, proc, what="the first checkpoint")
    proc.send_signal(signal.SIGTERM)  # as a spot VM's shutdown would, to the launcher
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "preempted" and status["exit_code"] == 3
    stopped = latest_step(run)
    assert 16 <= stopped < 128
    ckpt_meta = json.loads((run / "checkpoints" / f"step-{stopped:08d}" / "meta.json").read_text())
    assert ckpt_meta["step"] == stopped  # the SIGTERM save is the newest complete checkpoint
    assert_no_workers_left([run])
    kinds = [(e["event"], e["step"]) for e in events(run)]
    assert kinds[0] == ("started", 0) and kinds[-1] == ("preempted", stopped), kinds
    periodic = list(range(16, stopped + 1, 16))
    assert [s for k, s in kinds if k == "checkpoint"] == periodic + ([stopped] if stopped % 16 else []), kinds

    resume_equals_reference(tmp_path, run, stopped, reference, stopped_at=stopped, by_path=True)
    kinds = [(e["event"], e["step"]) for e in events(run)]
    assert kinds[-2:] == [("checkpoint", 128), ("completed", 128)], kinds
    assert ("resumed", stopped) in kinds and kinds.index(("resumed", stopped)) > kinds.index(("preempted", stopped))
    # metrics.jsonl is the uninterrupted stream: each logged step once, in order (the resume dropped
    # what it replayed).
    steps = [m["step"] for m in metrics(run) if "loss" in m]
    assert steps == sorted(set(steps)) == list(range(16, 129, 16)), steps

    # The finished run resumed again (as a Slurm requeue does when a stop reached it after it completed): nothing
    # is left to train; it evaluates its final weights and completes with the same result.
    again = dtrain(["train", "mnist", "--resume", run.name, "--output", "runs"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    result = json.loads((run / "status.json").read_text())["result"]
    want = json.loads((reference / "status.json").read_text())["result"]
    assert (result["steps"], result["accuracy"]) == (128, want["accuracy"]), result


def test_sigterm_to_a_single_process_without_torchrun(tmp_path):
    args = [
        sys.executable,
        "-m",
        "dtrain.mnist.train",
        *SMALL,
        "--epochs",
        "2",
        "--output",
        "runs",
        "--log-every",
        "16",
    ]
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=env(DTRAIN_INTERNAL_FAULT_PAUSE_BEFORE_COMMIT="0.4"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = run_dir_of(tmp_path, proc)
    wait_for(lambda: latest_step(run) >= 16, proc, what="the first checkpoint")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "preempted" in out
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "preempted" and latest_step(run) > 16


def test_a_run_in_a_bucket_checkpoints_there_and_resumes_from_it(tmp_path, gcs_bucket):
    out = f"{gcs_bucket}/runs"
    r = dtrain(["train", "mnist", *SMALL, "--epochs", "1", "--nproc", "2", "--output", out], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    root = open_store(out)
    run_id = only_run_in_bucket(out, tmp_path, (*RUN_FILES, "final/model.safetensors", "final/model.json"))
    # As for a user's script: the checkpoints were written to a local checkpoint directory ($DTRAIN_CHECKPOINT_DIR)
    # and copied to the run's ckpt/; read in place there, they are the workload's own layout.
    have = bucket_checkpoints(out, run_id)
    assert {"LATEST", "step-00000064/state.pt", "step-00000064/meta.json"} <= set(have), have
    assert checkpoints(root.child(run_id)).read_bytes("LATEST") == b"step-00000064"

    local = cache_dir() / "jobs" / run_id / "checkpoints"
    shutil.rmtree(local)  # the resume starts from the bucket's copy, not from what this machine kept
    r = dtrain(["train", "mnist", "--resume", run_id, "--output", out, "--epochs", "2"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint directory restored" in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"resuming from {local}/step-00000064 (step 64)" in r.stdout
    status = json.loads(root.read_bytes(f"{run_id}/status.json"))
    assert status["state"] == "completed" and status["result"]["steps"] == 128
    # The run's events and metrics are in the bucket as one ordered stream each, across both launches.
    rows = [json.loads(ln) for ln in root.read_bytes(f"{run_id}/events.jsonl").decode().splitlines()]
    assert [(e["event"], e["step"]) for e in rows] == [
        ("started", 0), *[("checkpoint", s) for s in (16, 32, 48, 64)], ("completed", 64),
        ("resumed", 64), *[("checkpoint", s) for s in (80, 96, 112, 128)], ("completed", 128),
    ]  # fmt: skip
    lines = [json.loads(ln) for ln in root.read_bytes(f"{run_id}/metrics.jsonl").decode().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == list(range(16, 129, 16))
    # TensorBoard's event files were written locally and copied up: they hold every logged loss.
    tb = [n for n in root.list(f"{run_id}/tensorboard") if "tfevents" in n]
    assert tb, root.list(run_id)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for i, name in enumerate(tb):
        (tmp_path / "tb").mkdir(exist_ok=True)
        (tmp_path / "tb" / f"{i}.tfevents").write_bytes(root.read_bytes(name))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted({e.step for e in acc.Scalars("loss")}) == list(range(16, 129, 16))


HUNG = textwrap.dedent("""
    import os, time
    from dtrain.common.dist import distributed
    with distributed(timeout_s=4) as d:
        if d.rank == 1:
            time.sleep(60)  # hung: never reaches the barrier
        d.barrier("after setup")
""")


def test_a_hung_peer_is_named_with_its_host(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    cmd = [
        sys.executable,
        "-m",
        "dtrain.common.launch",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        str(script),
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    host = os.uname().nodename
    assert f"waited 4s at barrier 'after setup' for rank 1 on {host} (pid" in r.stderr, r.stderr
