"""The local launcher's bounds and lifetimes, through the real CLI: how many processes it starts, and
that none of them outlives it, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import write_dataset
from runs import CLI, cli, isolated_env

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.local import MAX_PROCS_PER_CORE, processes

CPUS = os.cpu_count() or 1
GONE_WITHIN_S = 10.0  # the bar: no process of the run 10 s after the launcher died


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("tiny-mnist"), 512, 128, seed=0)


def test_more_processes_than_cores_is_refused_before_anything_starts(tmp_path, tiny_data):
    n = CPUS + 1
    r = cli(tmp_path, "train", "mnist", "--nproc", str(n), "--data-dir", str(tiny_data), "--epochs", "1")
    assert r.code == ExitCode.USAGE, r.err
    assert r.error_line() == (
        f"error: --nproc {n} is more processes than this machine's {CPUS} CPU core(s): use --nproc {CPUS} or "
        "fewer, or add --oversubscribe to run more anyway"
    )
    assert not (tmp_path / "runs").exists()


def test_oversubscribe_has_a_ceiling(tmp_path, tiny_data):
    n = MAX_PROCS_PER_CORE * CPUS + 1
    r = cli(tmp_path, "train", "mnist", "--nproc", str(n), "--oversubscribe", "--data-dir", str(tiny_data))
    assert r.code == ExitCode.USAGE, r.err
    assert r.error_line() == (
        f"error: --nproc {n} is more than {MAX_PROCS_PER_CORE} processes per core even with --oversubscribe "
        f"(this machine has {CPUS} cores): use --nproc {MAX_PROCS_PER_CORE * CPUS} or fewer"
    )
    assert not (tmp_path / "runs").exists()


def test_oversubscribe_runs_more_processes_than_cores(tmp_path, tiny_data):
    n = CPUS + 1
    r = cli(
        tmp_path, "train", "mnist", "--nproc", str(n), "--oversubscribe", "--data-dir", str(tiny_data),
        "--epochs", "1", "--batch-size", str(16 * n), "--eval-batch-size", "64",
    )  # fmt: skip
    assert r.code == ExitCode.OK, r.out + r.err
    assert f"{n} process(es) x 1 thread(s)" in r.out


def test_gpus_bound_processes_on_a_gpu_machine():
    assert processes(0, gpus=2, cpus=16, oversubscribe=False) == 2
    assert processes(2, gpus=2, cpus=16, oversubscribe=False) == 2
    with pytest.raises(UserError, match=r"^--nproc 3 is more processes than this machine's 2 GPU\(s\)"):
        processes(3, gpus=2, cpus=16, oversubscribe=False)
    assert processes(3, gpus=2, cpus=16, oversubscribe=True) == 3


def _processes_of(run_id: str) -> list[str]:
    """Every process whose command line names the run (torchrun's agent and its workers)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if run_id in args and "dtrain.mnist.train" in args:
            found.append(f"{pid} {args}")
    return found


def _workers_of(run_id: str) -> list[str]:
    return [p for p in _processes_of(run_id) if "-m dtrain.mnist.train" in p and "dtrain.common.launch" not in p]


@pytest.mark.parametrize("who", ["launcher", "agent"])
def test_sigkill_during_startup_leaves_no_process_of_the_run(tmp_path, tiny_data, who):
    """SIGKILL to dtrain (the launcher), or to torchrun's agent, the moment the workers exist: they are
    still importing torch, with no signal handler of their own yet."""
    run_id = f"mnist-kill-{who}"
    args = ["train", "mnist", "--nproc", "2", "--data-dir", str(tiny_data), "--epochs", "50", "--run-id", run_id]
    proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=isolated_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_workers_of(run_id)) < 2:
            assert proc.poll() is None, f"dtrain exited ({proc.returncode}) before starting its workers"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.01)
        if who == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            (agent,) = [p for p in _processes_of(run_id) if "dtrain.common.launch" in p]
            os.kill(int(agent.split()[0]), signal.SIGKILL)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _processes_of(run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_of(run_id) == [], f"still running {GONE_WITHIN_S:.0f} s after the {who} was killed"
    finally:
        proc.kill()
        proc.wait()
        for line in _processes_of(run_id):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def test_a_running_runs_status_names_the_launcher_that_records_its_end(tmp_path, tiny_data):
    """The built-in runs under the same launcher as a user's program, which records the start and the end: while
    it trains, status.json's pid is the launcher's (the process `dtrain runs` checks is alive: a rank that died
    before the launcher recorded the end is no "stopped" run), its ranks are the peers, and its start is counted.
    After a Ctrl-C the run says interrupted, and `dtrain runs` agrees."""
    import json

    args = ["train", "mnist", "--nproc", "1", "--data-dir", str(tiny_data), "--epochs", "50", "--run-id", "mnist-pid"]
    proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=isolated_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    status_file = tmp_path / "runs" / "mnist-pid" / "status.json"
    try:
        deadline = time.monotonic() + 120
        status: dict = {}
        while not status.get("peers") or status["peers"][0].get("rank") is None:
            assert proc.poll() is None, f"dtrain exited ({proc.returncode}) before its run was running"
            assert time.monotonic() < deadline, f"the run never reported its ranks: {status}"
            time.sleep(0.1)
            try:
                status = json.loads(status_file.read_text())
            except (FileNotFoundError, ValueError):
                status = {}
        assert status["state"] == "running" and status["pid"] == proc.pid and status["starts"] == 1, status
        assert [p["rank"] for p in status["peers"]] == [0] and status["peers"][0]["pid"] != proc.pid, status
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == ExitCode.INTERRUPTED
    finally:
        proc.kill()
        proc.wait()
    status = json.loads(status_file.read_text())
    assert status["state"] == "interrupted" and status["exit_code"] == ExitCode.INTERRUPTED, status
    r = cli(tmp_path, "runs", "--json")
    assert r.code == 0, r.err
    assert [(row["run_id"], row["status"]) for row in json.loads(r.out)] == [("mnist-pid", "interrupted")]
