"""Hang detection on this machine (docs/hangs.md), through the real CLI: a rank of a job that `dtrain train` runs
here (a user's program, a built-in) is frozen with SIGSTOP, what a GPU, NCCL or filesystem hang looks like from
outside. The launcher finds it, saves its Python stacks into the run, says so in one line and a "hang" event, and
stops the job (exit 4) with nothing left running, or, with --max-restarts, has torchrun start the ranks again from
the last complete checkpoint. Real torchrun, gloo and processes; tests/cluster/test_hangs.py is the same on hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import write_dataset
from runs import CLI, isolated_env, stop_labels

from dtrain.common.checkpoint import find_latest
from dtrain.common.errors import ExitCode
from dtrain.common.progress import env_value
from dtrain.common.rundir import read_json
from dtrain.common.storage import open_store

HOST = socket.gethostname()
RUN_TIMEOUT_S = 300

# A user's program with the SDK and no torch of its own (quick to start): every rank steps and beats; rank 1 takes
# three times as long a step (a straggler: the ranks never meet, so each keeps its own pace).
SDK_SCRIPT = """\
import os
import time

from dtrain import sdk


def train_step(rank):
    time.sleep(0.3 if rank == 1 else 0.1)


def main():
    rank = int(os.environ["RANK"])
    for step in range(1, 100000):
        train_step(rank)
        sdk.log(step, loss=1.0 / step)


main()
"""


def _start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], cwd=cwd, env=isolated_env(cwd, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _job_processes(run_id: str) -> list[int]:
    """Every process of the run's job: they all carry DTRAIN_RUN (a program) or the run id in their command
    line (a built-in's torchrun and workers)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            args = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if env_value(int(name), "DTRAIN_RUN") == run_id or run_id in args:
            found.append(int(name))
    return found


def _ranks(run_id: str) -> dict[str, int]:
    """rank -> pid of the run's ranks (the processes torchrun started, carrying RANK)."""
    out = {}
    for pid in _job_processes(run_id):
        rank, parent_rank = env_value(pid, "RANK"), None
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent_rank = env_value(ppid, "RANK")
        except (OSError, IndexError, ValueError):
            pass
        if rank is not None and parent_rank is None:
            out[rank] = pid
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _wait(predicate, proc: subprocess.Popen, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"dtrain ended (exit {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}:\n{proc.stdout.read()}")


def _only_run(out: Path) -> Path | None:
    runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
    return runs[0] if len(runs) == 1 else None


def _finish(proc: subprocess.Popen, frozen: list[int]) -> str:
    try:
        text, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        return text
    finally:
        if proc.poll() is None:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def _hang_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("dtrain: hang on ")]
    assert len(lines) == 1, text
    return lines[0]


def test_a_frozen_rank_of_a_users_program_is_found_named_and_stopped_and_a_slow_one_is_a_straggler(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.py").write_text(SDK_SCRIPT)
    out = tmp_path / "runs"
    p = _start(["train", "train.py", "--nproc", "2", "--hang-timeout", "4", "--output", str(out)], tmp_path)
    frozen: list[int] = []
    try:
        run = _wait(lambda: _only_run(out), p, "the run directory")
        # Rank 1's steps take 3x rank 0's: a straggler event names it (shown, not stopped).
        stragglers = _wait(lambda: [e for e in _rows(run / "events.jsonl") if e["event"] == "straggler"], p,
                           "a straggler event", timeout=60)  # fmt: skip
        assert stragglers[0]["stragglers"].keys() == {f"{HOST} rank 1"}, stragglers
        assert stragglers[0]["stragglers"][f"{HOST} rank 1"] > 1.5, stragglers  # 3x slower steps, less overheads
        pid = _ranks(run.name)["0"]
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        frozen_at = time.time()
    finally:
        text = _finish(p, frozen)
    assert p.returncode == ExitCode.HUNG, text
    line = _hang_line(text)
    stack_file = run / "hangs" / f"{HOST}-rank0.txt"
    assert line.startswith(f"dtrain: hang on {HOST} rank 0: no progress for "), line
    assert "since step " in line and line.endswith(f"; stacks in {stack_file}"), line
    assert "in train_step" in stack_file.read_text()  # where the frozen rank was
    hangs = [e for e in _rows(run / "events.jsonl") if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["node"] == HOST and hangs[0]["rank"] == "0" and hangs[0]["state"] == "T", hangs
    # Not before the timeout, counted from the rank's last heartbeat (at most a second before the freeze).
    assert hangs[0]["timeout_s"] == 4.0 and hangs[0]["time"] - frozen_at >= 3.0, (hangs, frozen_at)
    status = read_json(open_store(str(run)), "status.json")
    assert (status["state"], status["exit_code"]) == ("failed", 4), status
    assert status["error"].startswith("hung: no progress for ") and f"s on {HOST} rank 0 since step " in status["error"]
    assert _job_processes(run.name) == [], "processes of the job are still running"
    assert f"run {run.name} failed (exit 4)" in text, text


def _mnist_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "mnist", "--nproc", "2", "--data-dir", str(data), "--output", str(out), "--batch-size", "64",
            "--eval-batch-size", "256", "--checkpoint-every", "20", "--log-every", "5", *extra]  # fmt: skip


def _latest(run: Path) -> int:
    found = find_latest(open_store(str(run / "checkpoints"))) if (run / "checkpoints").exists() else None
    return found.step if found else -1


def _trained_for(run: Path) -> float:
    rows = [m for m in _rows(run / "metrics.jsonl") if "loss" in m]
    return rows[-1]["time"] - rows[0]["time"] if rows else 0.0


def _freeze_after_checkpoint(p: subprocess.Popen, out: Path, rank: str) -> tuple[Path, int, int, float]:
    """Once the run has a complete checkpoint and has trained for a few seconds (the automatic timeout needs a
    few heartbeats, which come at most once a second, to know the step time): SIGSTOP to one rank; (run, its
    pid, the checkpoint, when)."""
    run = _wait(lambda: _only_run(out), p, "the run directory")
    _wait(lambda: _latest(run) > 0 and _trained_for(run) >= 4.0, p, "a checkpoint and 4 s of training")
    ckpt = _latest(run)
    ranks = _wait(lambda: len(r := _ranks(run.name)) == 2 and r, p, "both ranks")
    os.kill(ranks[rank], signal.SIGSTOP)
    return run, ranks[rank], ckpt, time.time()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("tiny-mnist"), 1024, 256, seed=0)


@pytest.mark.slow  # about 20-25 s: start-up, training, the 10 s hang timeout, the stop
def test_a_frozen_rank_of_a_builtin_stops_the_job_with_exit_4_and_its_stacks(tmp_path: Path, tiny_data: Path) -> None:
    out = tmp_path / "runs"
    p = _start(_mnist_args(tiny_data, out, "--epochs", "200", "--hang-timeout", "10"), tmp_path)
    frozen: list[int] = []
    try:
        run, pid, _ckpt, frozen_at = _freeze_after_checkpoint(p, out, "1")
        frozen.append(pid)
    finally:
        text = _finish(p, frozen)
    assert p.returncode == ExitCode.HUNG, text
    line = _hang_line(text)
    assert line.startswith(f"dtrain: hang on {HOST} rank 1: no progress for "), line
    assert line.endswith(f"; stacks in {run / 'hangs' / f'{HOST}-rank1.txt'}"), line
    assert "mnist/train.py" in (run / "hangs" / f"{HOST}-rank1.txt").read_text()  # in the training loop
    hangs = [e for e in _rows(run / "events.jsonl") if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["rank"] == "1" and hangs[0]["step"] is not None, hangs
    assert stop_labels(_rows(run / "events.jsonl")) == ["hang"], _rows(run / "events.jsonl")
    assert hangs[0]["time"] - frozen_at >= 9.0, hangs  # never before its timeout (from the last heartbeat)
    status = read_json(open_store(str(run)), "status.json")
    assert (status["state"], status["exit_code"]) == ("failed", 4), status
    assert status["error"].startswith("hung: no progress for ") and f"on {HOST} rank 1 since step" in status["error"]
    assert _job_processes(run.name) == [], "processes of the job are still running"


@pytest.mark.slow  # about 50 s: the default (30 s) timeout, a restart, the rest of the training
def test_a_frozen_builtin_with_the_default_timeout_restarts_from_its_checkpoint_and_completes(
    tmp_path: Path, tiny_data: Path
) -> None:
    """The figures for docs/hangs.md: freeze -> detection and freeze -> training again, default timeout."""
    out = tmp_path / "runs"
    p = _start(_mnist_args(tiny_data, out, "--epochs", "40", "--max-restarts", "1"), tmp_path)
    frozen: list[int] = []
    try:
        run, pid, ckpt, frozen_at = _freeze_after_checkpoint(p, out, "1")
        frozen.append(pid)
    finally:
        text = _finish(p, frozen)
    assert p.returncode == 0, text
    assert _hang_line(text).startswith(f"dtrain: hang on {HOST} rank 1: no progress for "), text
    assert "restart 1 of 1" in text, text
    events = _rows(run / "events.jsonl")
    hangs = [e for e in events if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["timeout_s"] >= 30.0, hangs  # the automatic timeout, with its floor
    assert stop_labels(events) == ["hang"], events  # not also rank 0's `preempted (SIGTERM): checkpoint saved`
    resumed = [e for e in events if e["event"] == "resumed" and e["time"] > hangs[0]["time"]]
    assert resumed and resumed[0]["step"] >= ckpt, events  # from the last complete checkpoint
    again = [m for m in _rows(run / "metrics.jsonl") if m["time"] > resumed[0]["time"] and "loss" in m]
    assert again, "no training metrics after the restart"
    status = read_json(open_store(str(run)), "status.json")
    assert status["state"] == "completed", status
    assert _job_processes(run.name) == []
    detect_s, again_s = hangs[0]["time"] - frozen_at, again[0]["time"] - frozen_at
    restored_s = resumed[0]["time"] - frozen_at
    print(f"\nthis machine, default timeout ({hangs[0]['timeout_s']:.0f} s): freeze -> detection {detect_s:.1f} s; "
          f"freeze -> training again {again_s:.1f} s (the first metrics row after the restart, step "
          f"{again[0]['step']}; checkpoint step {resumed[0]['step']} restored at {restored_s:.1f} s)")  # fmt: skip


@pytest.mark.slow  # about 30 s: a torchrun script, the hang timeout, a restart, the rest of its 150 steps (7.5 s)
def test_a_frozen_torchrun_script_without_the_sdk_is_judged_by_cpu_and_restarts_from_its_own_checkpoint(
    tmp_path: Path,
) -> None:
    from projects import make_ddp_project

    project = make_ddp_project(tmp_path / "proj")
    out = tmp_path / "runs"
    args = ["train", "train.py", "--output", str(out), "--hang-timeout", "10", "--max-restarts", "1", "--",
            "--steps", "150", "--ckpt-every", "10", "--sleep", "0.05"]  # fmt: skip
    p = _start(args, project)
    frozen: list[int] = []
    try:
        run = _wait(lambda: _only_run(out), p, "the run directory")
        ckpt = project / "checkpoints" / "ckpt.pt"
        _wait(lambda: ckpt.exists(), p, "the script's first checkpoint")
        ranks = _wait(lambda: len(r := _ranks(run.name)) == 2 and r, p, "both ranks")
        os.kill(ranks["1"], signal.SIGSTOP)
        frozen.append(ranks["1"])
    finally:
        text = _finish(p, frozen)
    assert p.returncode == 0, text
    line = _hang_line(text)
    assert line.startswith(f"dtrain: hang on {HOST} rank 1: no progress for ") and "before its first step" in line
    assert "in main" in (run / "hangs" / f"{HOST}-rank1.txt").read_text()
    resumed = [ln for ln in text.splitlines() if ln.startswith("resumed at step ")]
    assert resumed and int(resumed[0].split()[-1]) >= 10, text
    assert "final weights" in text, text
    status = read_json(open_store(str(run)), "status.json")
    assert (status["state"], status["exit_code"]) == ("completed", 0), status
    assert _job_processes(run.name) == []
