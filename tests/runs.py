"""Driving real runs from tests: the CLI in a subprocess, waiting on a run's files, and checking
that nothing of a run is left running."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.common.checkpoint import find_latest
from dtrain.common.storage import open_store

CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]
ENV = {"DTRAIN_OFFLINE": "1"}  # tests never reach the internet
POLL_S = 0.05


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENV, **extra}


def dtrain(args: list[str], cwd: Path, timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout, check=False
    )


def start(args: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def stop_labels(rows: list[dict]) -> list[str]:
    """The stop labels of a run's events.jsonl rows, in order (dtrain.common.runrecord: one per stop)."""
    from dtrain.common.runrecord import STOP_LABELS

    return [r["event"] for r in rows if r.get("event") in STOP_LABELS]


def only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{out}")
        time.sleep(POLL_S)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def latest_step(run: Path) -> int:
    found = find_latest(open_store(str(run / "checkpoints"))) if (run / "checkpoints").exists() else None
    return found.step if found else 0


def peers(run: Path) -> list[dict]:
    status = json.loads((run / "status.json").read_text())
    return status.get("peers", []) if status.get("state") == "running" else []


def assert_no_workers_left(run_dirs: list[Path]) -> None:
    """No process of these runs survives (the launcher and PR_SET_PDEATHSIG see to it)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for run in run_dirs:
        assert run.name not in out, f"processes of {run.name} are still running:\n{out}"


def processes_in(folder: Path) -> list[str]:
    """The processes working in `folder` (a run's workers there, whatever started them), as command lines."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "cwd")).resolve() == folder.resolve():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def run_dir_of(cwd: Path, proc: subprocess.Popen) -> Path:
    """The one run directory under cwd/runs, once the run has made it."""
    runs = cwd / "runs"
    return wait_for(lambda: runs.exists() and any(runs.iterdir()) and only_run(runs), proc, what="the run directory")


# What every run directory holds, whatever the workload.
RUN_FILES = ("config.json", "status.json", "metrics.jsonl")


def bucket_checkpoints(out: str, run_id: str) -> list[str]:
    """The files of a gs:// run's checkpoint directory, as the run holds them: written on this machine's local
    checkpoint directory ($DTRAIN_CHECKPOINT_DIR) and copied to the run's ckpt/ (dtrain.common.mirror), read in
    place (dtrain.common.rundir.checkpoints)."""
    from dtrain.common.rundir import checkpoints

    run = open_store(out).child(run_id)
    assert any(n.startswith("ckpt/node-00000/") for n in run.list("ckpt")), run.list("")
    return checkpoints(run).list("")


def read_until_copied(proc: subprocess.Popen, step: int, timeout: float = 300) -> str:
    """The launcher's output up to the first line saying node 0's checkpoint mirror saved a copy, after the
    ddp project's `step <step+3>` line (its checkpoint of `step` was written three steps before, and a scan
    takes milliseconds, so that copy holds it). What the tests kill the launcher after: a kill at a fixed
    step would race the mirror's settle rule (a file is copied once two scans see it unchanged)."""
    seen, after = "", False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen
        seen += line
        after = after or f"step {step + 3} " in line
        if after and "checkpoint mirror: node 0 saved" in line:
            return seen
    raise AssertionError(f"no copy of the step-{step} checkpoint within {timeout:g}s:\n{seen}")


def only_run_in_bucket(out: str, cwd: Path, expected: tuple[str, ...]) -> str:
    """The id of the one run under the gs:// prefix `out`, after checking it holds `expected` and that
    nothing went to the local disk."""
    names = open_store(out).list("")
    (run_id,) = {n.split("/")[0] for n in names}
    missing = [e for e in expected if f"{run_id}/{e}" not in names]
    assert not missing, f"not in the bucket: {missing}; it has {names}"
    assert not (cwd / "runs").exists()
    return run_id


# -- bad-input checks: one isolated CLI call, its exit code and its single error line ----------------

CLI_TIMEOUT_S = 120


@dataclasses.dataclass
class Result:
    code: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one `error:` line on stderr, after checking there is exactly one and no traceback."""
        assert "Traceback" not in self.err, self.err
        lines = [ln for ln in self.err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, self.err
        return lines[0]


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any DTRAIN_* or HF_* setting, offline, with caches in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRAIN_", "HF_"))}
    env.update(DTRAIN_OFFLINE="1", DTRAIN_CACHE_DIR=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    env.update(extra)
    return env


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    p = subprocess.run(
        [*CLI, *args],
        cwd=cwd,
        env=env if env is not None else isolated_env(cwd),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    return Result(p.returncode, p.stdout, p.stderr)


def snapshot(root: Path, prefix: str = "") -> dict[str, bytes]:
    """Every file under `root` (path relative to it, after `prefix`) and its bytes."""
    return {prefix + p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclasses.dataclass
class RefusedResume:
    """A completed run, a resume of it that must be refused, and the run's files before and after."""

    run_dir: Path
    first: Result
    resumed: Result
    files_before: dict[str, bytes]
    files_after: dict[str, bytes]
    runs_json: list[dict]


# -- a workload in this process ---------------------------------------------------------------------


def in_process(main, argv: list[str], monkeypatch: pytest.MonkeyPatch, **launcher_env: str) -> int:
    """Run a workload's `main(argv)` here (so a test can replace a function inside it) and return its
    exit code: one process without torchrun, or with `launcher_env` the variables torchrun would set."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


def forced_fp16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the workloads run in fp16 with loss scaling on this CPU, as `auto` does on a T4:
    torch's CPU autocast takes float16 and GradScaler("cpu") scales and unscales on the CPU.
    (--precision fp16 refuses a CPU, rightly, for users: it is slow there.)"""
    import torch

    from dtrain.common import workload
    from dtrain.common.config import Precision
    from dtrain.common.precision import PrecisionPolicy

    policy = PrecisionPolicy(Precision.FP16, torch.device("cpu"), "fp16 forced on the CPU by a test")
    monkeypatch.setattr(workload, "resolve_precision", lambda requested, device: policy)


# -- jobs of a few processes without torchrun -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """The variables torchrun gives a worker of a `world_size`-process job on this machine (gloo over
    loopback); `extra` overrides them (LOCAL_RANK=0 on every rank makes each a node of its own)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo", **extra}  # fmt: skip


def run_ranks(script: Path, ranks: list[dict[str, str]], *args: str, timeout: float = 120) -> list[dict]:
    """`script` as one job of len(ranks) processes, rank i with `ranks[i]` added to its variables;
    after checking that all exited 0, the JSON each printed last."""
    port, procs = free_port(), []
    for i, extra in enumerate(ranks):
        env = {**os.environ, **rank_env(i, len(ranks), port, **extra)}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
