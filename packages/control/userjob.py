"""A job's run and its program on this machine: the run's place (`Target`, `program_target`), its records
(`record_start`, `record_end`), dtrain's variables (`contract_env`), and the local launcher's work
(`run_program_here`, `supervise`). A job reaches here as a launchers.Plan from the one front door,
dtrain.control.launch (a built-in is a program by then).

The run is the same as a built-in's: `<output>/<run id>/` with config.json (the job, written here
before the program starts), status.json (state and exit code, written here when it ends),
metrics.jsonl (what the SDK logs), logs/ and ckpt/ (the checkpoint directory's copies,
dtrain.common.mirror). The program gets dtrain's variables (dtrain.common.jobenv) on every node.

On this machine the program runs in the working directory itself; on a cluster's nodes in a synced
copy of it (remote.py). Its requirements are installed once per content hash (dtrain.common.deps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.common import jobenv, runrecord
from dtrain.common.errors import ExitCode, UserError, stop_outcome
from dtrain.common.launch import torchrun_argv
from dtrain.common.procs import dies_with_parent
from dtrain.common.rundir import CHECKPOINTS, CKPT_PREFIX, read_json, run_disk_full, write_json
from dtrain.common.storage import DiskFull, Store, is_remote
from dtrain.control.events import Events, Handle, Stop
from dtrain.control.program import Job, run_prefix

# The copy interval of the checkpoint directory (tests shorten it; 30 s costs a long run nothing).
MIRROR_INTERVAL_S = float(os.environ.get("DTRAIN_INTERNAL_MIRROR_INTERVAL_S", "30"))


POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a program's run lives: its id, its store, and how many times it has started before."""

    run_id: str
    run: Store
    restarts: int  # starts before this one (a --resume counts one)
    resumed: bool


def program_target(job: Job, output: str, run_id: str, resume: str) -> Target:
    """A new run under `output`, or the run `resume` names (which must be a run of the same job)."""
    from dtrain.common.rundir import locate, run_location

    if resume:
        run = locate(output, resume)
        cfg = read_json(run, "config.json") or {}
        if cfg.get("kind") != "program":
            what = cfg.get("workload") or "a built-in"
            raise UserError(f"run {run.url} is a {what} run: resume it with `dtrain train {what} --resume ...`")
        return resumed_target(run)
    rid, run = run_location(run_prefix(job.name), output, run_id)
    return Target(rid, run, 0, False)


def resumed_target(run: Store) -> Target:
    """The run `run`, continued: its id, and the starts its status.json counts (1 where it counts none)."""
    status = runrecord.read_status(run) or {}
    return Target(run.url.rstrip("/").rsplit("/", 1)[-1], run, int(status.get("starts", 1)), True)


def program_config(t: Target, job: Job, *, cluster: str, nodes: int, nproc: int | None) -> dict[str, Any]:
    """A program run's config.json (nproc None: worked out on the nodes, as for a queued Slurm job)."""
    return {
        "workload": job.name,
        "kind": "program",
        "job": job.to_json(),
        "run_id": t.run_id,
        "created": time.time(),
        "cluster": cluster,
        "world_size": nodes * nproc if job.program.under_torchrun and nproc else None,
        "nodes": nodes,
    }


def record_start(
    plan: Any, *, cluster: str, nodes: int, nproc: int, hosts: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """config.json for a new run of `plan` (a launchers.Plan; a resumed run keeps its own, and a program that
    writes its own, `plan.own_config`, gets none), and status.json: running, on `hosts`
    (dtrain.common.runrecord). Returns the status.json it replaced (None: there was none)."""
    t, job = plan.target, plan.job
    try:
        if not t.resumed and not plan.own_config:
            write_json(t.run, "config.json", program_config(t, job, cluster=cluster, nodes=nodes, nproc=nproc))
        here = os.uname().nodename
        return runrecord.record_start(t.run, starts=t.restarts + 1, host=here, pid=os.getpid(),
                                      peers=[{"host": h} for h in hosts or (here,)])  # fmt: skip
    except DiskFull as e:  # one line, and the run's files as they were
        raise run_disk_full(e, t.run_id, resumed=t.resumed) from None


def record_end(t: Target, code: int, error: str = "", before: dict[str, Any] | None = None) -> int:
    """status.json at the job's end, from its exit code (dtrain.common.runrecord.record_end: a built-in that
    recorded its completion before a stop came stays completed, and a stop that ended PREEMPTED gets its label);
    returns that code. A run the program never opened (a built-in's --show-example, or its input refused) leaves
    nothing; a resume the program refused for its input (exit USAGE: a built-in given another model config)
    leaves the run's status as it was (`before`, what record_start replaced)."""
    if not t.run.exists("config.json"):
        with contextlib.suppress(OSError, UserError):
            if set(t.run.list("")) <= {runrecord.STATUS}:  # only record_start's: no debris
                t.run.delete("")
        return code
    if code == ExitCode.USAGE and t.resumed and before is not None:
        with contextlib.suppress(OSError, UserError):
            runrecord.write_status(t.run, before)
        return code
    with contextlib.suppress(OSError, UserError):
        return runrecord.record_end(t.run, code, error=error)
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def contract_env(
    t: Target,
    *,
    checkpoint_dir: str,
    metrics_file: str,
    stop_file: str,
    code_dir: str,
    node_rank: int,
    nnodes: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    command: bool,
) -> dict[str, str]:
    """dtrain's variables for one node's processes (dtrain.common.jobenv), and for a command also the plain
    NODE_RANK/NNODES/... names."""
    env = {
        jobenv.RUN: t.run_id,
        jobenv.RUN_URL: t.run.url,
        jobenv.CHECKPOINT_DIR: checkpoint_dir,
        jobenv.RESTART_COUNT: str(t.restarts),
        jobenv.STOP_FILE: stop_file,
        jobenv.METRICS_FILE: metrics_file,
        jobenv.CODE_DIR: code_dir,
        jobenv.NODE_RANK: str(node_rank),
        jobenv.NNODES: str(nnodes),
        jobenv.NPROC_PER_NODE: str(nproc),
        jobenv.MASTER_ADDR: master_addr,
        jobenv.MASTER_PORT: str(master_port),
    }
    if command:
        env.update({plain: env[ours] for plain, ours in jobenv.COMMAND_ENV.items()})
    return env


def run_program_here(plan: Any, *, events: Events, handle: Handle) -> int:
    """The program of `plan` (a launchers.Plan) on this machine, in its working directory (nothing to sync)."""
    from dtrain.common import deps
    from dtrain.common.env import cache_dir
    from dtrain.control.local import RESTARTABLE_ENV, count_gpus, processes

    job, t, nproc, max_restarts = plan.job, plan.target, plan.nproc, plan.max_restarts
    req = plan
    # A built-in (no working directory) is dtrain's own code, run from wherever the user is, with this Python.
    workdir = job.workdir or Path.cwd()
    if job.workdir is None and importlib.util.find_spec("torch") is None:
        raise UserError(
            f"training on this machine needs torch, which this Python ({sys.executable}) lacks: "
            "pip install 'dtrain[train]' (scripts/setup.sh does it), or train on a cluster with --cluster NAME"
        )
    gpus, cpus = count_gpus(), os.cpu_count() or 1
    n = processes(nproc, gpus=gpus, cpus=cpus, oversubscribe=req.oversubscribe) if job.program.under_torchrun else 1
    node_dir = cache_dir() / "jobs" / t.run_id
    node_dir.mkdir(parents=True, exist_ok=True)
    env_result = deps.EnvResult(python=sys.executable, key="", created=False, log_file=None)
    if job.workdir is not None:
        env_result = deps.ensure_env(
            job.workdir, cache_dir() / "envs", setup=job.setup, base_python=sys.executable, node="this machine",
            log=lambda m: events.info(f"dtrain: {m}"),
        )  # fmt: skip
    if not job.program.under_torchrun:  # a command that is not there: one line, before the run is made
        first = job.program.command_argv()[0]
        path = os.pathsep.join([str(Path(env_result.python).parent), os.environ.get("PATH", "")])
        found = shutil.which(first, path=path) if "/" not in first else str(workdir / first)
        if not found or not os.access(found, os.X_OK):
            raise UserError(f"command not found on this machine: {first} (install it, or give its full path)")
    if env_result.key:
        how = "installed" if env_result.created else "reused"
        events.emit("deps", f"requirements {how} ({env_result.key})", created=env_result.created, key=env_result.key)
    t.run.check_writable()  # one line, before anything is made there (nothing is, for a bad input above)
    local_run = not is_remote(t.run.url)
    if job.checkpoint_dir:
        ckpt = workdir / job.checkpoint_dir
    else:
        # a local run's own checkpoints/ (where a built-in reads them in place), else a folder of this machine's
        ckpt = Path(t.run.url) / CHECKPOINTS if local_run else node_dir / CHECKPOINTS
    ckpt.mkdir(parents=True, exist_ok=True)
    mirror = None
    job_pids: list[int] = []  # the job's process tree, as supervise last saw it
    killed_box: list[bool] = []  # supervise had to SIGKILL the job
    mirrored = not (local_run and not job.checkpoint_dir)  # a local run's own folder needs no copy
    metrics_file = Path(t.run.url) / "metrics.jsonl" if local_run else node_dir / "metrics.jsonl"
    before = record_start(plan, cluster="", nodes=1, nproc=n)
    if mirrored or not local_run:
        from dtrain.common.mirror import Forward, Mirror, restore

        if mirrored and t.resumed:
            got = restore(t.run.child(CKPT_PREFIX), ckpt, log=lambda m: events.info(f"dtrain: {m}"))
            if got is not None:
                events.emit("restored", f"checkpoint directory restored ({got.files} file(s))", files=got.files)
        forwards = [] if local_run else [Forward(metrics_file, t.run, "metrics.jsonl")]
        # Only the job's own processes are asked whether they hold a file open for writing.
        mirror = Mirror(ckpt, t.run.child(CKPT_PREFIX), node=0, forwards=forwards, interval_s=MIRROR_INTERVAL_S,
                        pids=lambda: list(job_pids), log=lambda m: events.info(f"dtrain: {m}"))  # fmt: skip
        mirror.start()
    stop_file = node_dir / "STOP"
    stop_file.unlink(missing_ok=True)
    env = {
        **os.environ,
        **job.env,
        **contract_env(
            t,
            checkpoint_dir=str(ckpt),
            metrics_file=str(metrics_file),
            stop_file=str(stop_file),
            code_dir=str(workdir),
            node_rank=0,
            nnodes=1,
            nproc=n,
            master_addr="127.0.0.1",
            master_port=free_port(),
            command=not job.program.under_torchrun,
        ),  # fmt: skip
        "PYTHONUNBUFFERED": "1",
        "DTRAIN_INTERNAL_TTY": "1" if req.tty else "0",  # a built-in's rank 0 draws a live bar on a terminal
    }
    if job.program.under_torchrun:
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(max(1, cpus // n))
        if max_restarts:
            env.update(RESTARTABLE_ENV)
        argv = torchrun_argv(env_result.python, job.program.torchrun_tail(), nproc=n, run_id=t.run_id,
                             max_restarts=max_restarts)  # fmt: skip
    else:
        argv = job.program.command_argv()
        # The job's Python first on PATH, as on a cluster's nodes: `python` is the one with torch (and the
        # requirements' virtualenv, with the tools it installed).
        venv_bin = str(Path(env_result.python).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        if env_result.key:
            env["VIRTUAL_ENV"] = str(Path(venv_bin).parent)
    if req.debug:
        env["DTRAIN_DEBUG"] = "1"
    events.emit(
        "launch",
        f"{'resuming' if t.resumed else 'starting'} {job.name} run {t.run_id} on this machine: "
        + (
            f"{n} process(es) x {env['OMP_NUM_THREADS']} thread(s) under torchrun"
            if job.program.under_torchrun
            else "a command"
        )
        + (f": {plan.line}" if plan.line else ""),
        run_id=t.run_id,
        workload=job.name,
        nodes=1,
        nproc=n,
    )
    from dtrain.control.hangwatch import LocalHangWatch

    # Hang detection (docs/hangs.md), by this launcher: torchrun's restarts bring hung ranks back; a command's
    # own launcher is not dtrain's to restart.
    watch = LocalHangWatch.start(plan.hang_timeout, env, t.run, events, startup_s=plan.startup_timeout,
                                 restarts=max_restarts if job.program.under_torchrun else 0)  # fmt: skip
    from dtrain.common.resources import Recorder, SamplerThread

    # Resource curves (docs/runs.md): this machine's rows into the run's resources/, its ranks' peaks in status.json.
    recorder = Recorder(t.run)
    here = os.uname().nodename
    sampler = SamplerThread(plan.sample_interval, lambda: list(job_pids), lambda row: recorder.add(here, row),
                            warn=lambda m: events.info(f"dtrain: warning: {m}")).start()  # fmt: skip
    code = int(ExitCode.FAILURE)
    try:
        code = supervise(argv, env=env, cwd=workdir, stop_file=stop_file, handle=handle, grace_s=req.grace_s,
                         what=job.program.describe(), pids=job_pids, killed=killed_box, watch=watch)  # fmt: skip
    finally:
        sampler.close()
        # its last rows and the peaks, before the end is recorded (both write status.json); none for a refusal
        recorder.close(refused=code == ExitCode.USAGE)
        if watch is not None:
            watch.close()
        if mirror is not None:
            # Killed (KILL, or past the grace period): only settled files, since a save may have been cut
            # off; otherwise the folder as the program left it.
            mirror.close(final=not killed_box)
        code = record_end(t, code, watch.error if watch is not None and code == ExitCode.HUNG else "", before)
    return code


def supervise(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    stop_file: Path,
    handle: Handle,
    grace_s: float,
    what: str,
    pids: list[int] | None = None,
    killed: list[bool] | None = None,
    watch: Any = None,
) -> int:
    """Run argv in a session of its own to its end. A stop request: the stop file appears and the signal goes
    to the whole session; past `grace_s` (or on KILL) everything left is killed. Returns our exit code.
    `pids`: kept up to date with the job's process tree (the checkpoint copy asks only those processes);
    `killed` gets True when the job had to be killed. `watch`: a hangwatch.LocalHangWatch; a hang it stops
    the job for ends it ExitCode.HUNG (SIGTERM to the session, SIGKILL HANG_GRACE_S later)."""
    from dtrain.common.nodeagent import HANG_GRACE_S, signal_tree, tree
    from dtrain.control.hangwatch import Action

    try:
        proc = subprocess.Popen(
            argv, env=dict(env), cwd=cwd, start_new_session=True, preexec_fn=dies_with_parent(signal.SIGTERM)
        )
    except FileNotFoundError:
        raise UserError(f"command not found on this machine: {argv[0]} (from: {what})") from None
    except PermissionError:
        raise UserError(f"cannot execute {argv[0]} on this machine: permission denied") from None
    forwarded: list[int] = []
    deadline = float("inf")
    snapshot = pids if pids is not None else []
    snapshot[:] = [proc.pid]
    hung = False
    try:
        while proc.poll() is None:
            if watch is not None and not hung and watch.check(proc.pid) == Action.STOP:
                hung = True  # nothing to save: a stuck rank answers neither the stop file nor SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + HANG_GRACE_S)
            for stop in handle.take():
                if stop == Stop.KILL:
                    if killed is not None:
                        killed.append(True)
                    signal_tree(proc.pid, signal.SIGKILL)
                    continue
                signum = signal.SIGINT if stop == Stop.INTERRUPT else signal.SIGTERM
                forwarded.append(signum)
                with contextlib.suppress(OSError):
                    stop_file.touch()
                deadline = min(deadline, time.monotonic() + grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signum)
            if time.monotonic() > deadline:
                if killed is not None:
                    killed.append(True)
                signal_tree(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            snapshot[:] = tree(proc.pid)
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in snapshot[1:]:  # whatever the program left behind (torchrun's workers sit in sessions of their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if watch is not None and watch.error and not forwarded:
        return int(ExitCode.HUNG)  # stopped for a hang, or its ranks killed and never started again
    return exit_code(proc.returncode, forwarded)


def exit_code(code: int, forwarded: list[int]) -> int:
    """The job's exit code from the program's: a program stopped by our SIGTERM that exits 0 or dies of it is
    PREEMPTED (it was asked to stop and did: safe to resume); Ctrl-C is INTERRUPTED."""
    if signal.SIGINT in forwarded:
        return int(ExitCode.INTERRUPTED)
    code = stop_outcome(code, signal.SIGTERM in forwarded)
    return int(ExitCode.FAILURE) if code < 0 else code
