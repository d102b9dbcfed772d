"""The user-facing SDK (dtrain.sdk), each case in a fresh Python process with exactly the environment a
job (or a plain `python train.py`) would have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dtrain.common import jobenv

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def run(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` with this environment minus dtrain's and torchrun's variables, plus `env`."""
    base = {k: v for k, v in os.environ.items() if k not in jobenv.ALL and k not in TORCHRUN_VARS}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture
def job(tmp_path: Path) -> dict[str, str]:
    """dtrain's variables for a job, pointing into tmp_path."""
    return {
        jobenv.RUN: "run-42",
        jobenv.METRICS_FILE: str(tmp_path / "metrics.jsonl"),
        jobenv.CHECKPOINT_DIR: str(tmp_path / "node" / "ckpt"),
        jobenv.STOP_FILE: str(tmp_path / "stop"),
        jobenv.RESTART_COUNT: "2",
        jobenv.NODE_RANK: "1",
    }


def metrics(job: dict[str, str]) -> list[dict]:
    path = Path(job[jobenv.METRICS_FILE])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_outside_dtrain_every_call_is_harmless(tmp_path: Path):
    r = run(
        """
        import json, signal
        from dtrain import sdk
        sdk.log(0, loss=1.0)
        sdk.log(loss=float("nan"))
        print(json.dumps({
            "in_dtrain": sdk.in_dtrain(), "run_id": sdk.run_id(), "restart_count": sdk.restart_count(),
            "node_rank": sdk.node_rank(), "main": sdk.is_main_process(), "stop": sdk.stop_requested(),
            "ckpt": str(sdk.checkpoint_dir()), "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        }))
        """,
        tmp_path,
    )
    assert json.loads(r.stdout) == {
        "in_dtrain": False,
        "run_id": None,
        "restart_count": 0,
        "node_rank": 0,
        "main": True,
        "stop": False,
        "ckpt": "checkpoints",
        "sigterm_default": True,  # importing the SDK installs no handler
    }
    assert r.stderr == ""
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]  # and nothing else was written


def test_in_a_job(tmp_path: Path, job: dict[str, str]):
    r = run(
        """
        import json
        from dtrain import sdk
        print(json.dumps([sdk.in_dtrain(), sdk.run_id(), sdk.restart_count(), sdk.node_rank(),
                          str(sdk.checkpoint_dir())]))
        """,
        tmp_path,
        **job,
    )
    assert json.loads(r.stdout) == [True, "run-42", 2, 1, job[jobenv.CHECKPOINT_DIR]]
    assert Path(job[jobenv.CHECKPOINT_DIR]).is_dir()


def test_log_appends_json_lines_on_rank_0_only(tmp_path: Path, job: dict[str, str]):
    code = """
        from dtrain import sdk
        sdk.log(0, loss=1.5, tokens=4096)
        sdk.log(1, loss=float("nan"), grad_norm=float("inf"))
        sdk.log(lr=3e-4)
        """
    before = time.time()
    run(code, tmp_path, **job, RANK="0")
    run(code, tmp_path, **job, RANK="1")
    after = time.time()
    lines = metrics(job)
    assert [{k: v for k, v in m.items() if k != "time"} for m in lines] == [
        {"step": 0, "loss": 1.5, "tokens": 4096},
        {"step": 1, "loss": None, "grad_norm": None},  # non-finite values are null: the file stays valid JSON
        {"step": None, "lr": 3e-4},
    ]
    assert all(before <= m["time"] <= after for m in lines)
    assert [m["time"] for m in lines] == sorted(m["time"] for m in lines)


def test_tensors_are_logged_as_floats(tmp_path: Path, job: dict[str, str]):
    pytest.importorskip("torch")
    run(
        """
        import torch
        from dtrain import sdk
        sdk.log(torch.tensor(7), loss=torch.tensor(0.25), acc=torch.tensor(1.0, dtype=torch.float64))
        """,
        tmp_path,
        **job,
    )
    [line] = Path(job[jobenv.METRICS_FILE]).read_text().splitlines()
    m = json.loads(line)
    assert (m["step"], m["loss"], m["acc"]) == (7, 0.25, 1.0)
    assert '"loss": 0.25' in line and '"acc": 1.0' in line  # numbers, not strings or lists


def test_a_value_that_is_not_a_number_is_refused(tmp_path: Path, job: dict[str, str]):
    r = run(
        """
        from dtrain import sdk
        try:
            sdk.log(0, loss="low")
        except ValueError as e:
            print(e)
        """,
        tmp_path,
        **job,
    )
    assert "loss='low' is not a number" in r.stdout
    assert metrics(job) == []


def test_write_errors_warn_once_and_never_raise(tmp_path: Path, job: dict[str, str]):
    job[jobenv.METRICS_FILE] = str(tmp_path / "no-such-dir" / "metrics.jsonl")
    r = run("from dtrain import sdk\nfor i in range(3): sdk.log(i, loss=1.0)\nprint('done')", tmp_path, **job)
    assert r.stdout == "done\n"
    assert len(r.stderr.splitlines()) == 1 and "cannot write metrics" in r.stderr, r.stderr


def test_stop_requested_flips_when_the_stop_file_appears(tmp_path: Path, job: dict[str, str]):
    # A fake clock: the file is looked at again only STOP_CHECK_EVERY_S after the last look.
    r = run(
        f"""
        import time
        from pathlib import Path
        now = [100.0]
        time.monotonic = lambda: now[0]
        from dtrain import sdk
        seen = [sdk.stop_requested()]
        Path({job[jobenv.STOP_FILE]!r}).touch()
        now[0] += 0.1
        seen.append(sdk.stop_requested())  # not looked at yet
        now[0] += sdk.STOP_CHECK_EVERY_S
        seen.append(sdk.stop_requested())
        Path({job[jobenv.STOP_FILE]!r}).unlink()
        now[0] += 10
        seen.append(sdk.stop_requested())  # once asked, stays asked
        print(seen)
        """,
        tmp_path,
        **job,
    )
    assert r.stdout.strip() == "[False, False, True, True]"


def test_sigterm_sets_the_flag_once_installed(tmp_path: Path):
    r = run(
        """
        import os, signal, time
        from dtrain import sdk
        calls = []
        signal.signal(signal.SIGTERM, lambda *a: calls.append("user"))
        before = sdk.stop_requested()
        sdk.install_sigterm_flag()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        print(before, sdk.stop_requested(), calls)
        """,
        tmp_path,
    )
    assert r.stdout.strip() == "False True ['user']"


def test_importing_the_sdk_imports_only_the_standard_library(tmp_path: Path):
    r = run(
        """
        import json, sys
        before = set(sys.modules)
        import dtrain.sdk
        new = sorted(set(sys.modules) - before)
        print(json.dumps([m for m in new if m.split(".")[0] not in sys.stdlib_module_names]))
        """,
        tmp_path,
    )
    outside = json.loads(r.stdout)
    assert "dtrain.sdk" in outside
    assert [m for m in outside if m != "dtrain" and not m.startswith("dtrain.")] == []
