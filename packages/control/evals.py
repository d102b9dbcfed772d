"""Evaluations and exports of runs: start one, list a run's, read one. No torch here: the torch side
is `python -m dtrain.evaluate` (packages/evaluate), started as a subprocess on this machine, or as a
one-process job on a cluster's master through its node agent, the way a training job starts there.

    plan = plan_eval(EvalRequest(run="mnist-20261101-120000-abcd"))   # checks, picks the id, records it
    record = run_eval(plan, events=events, handle=handle)              # runs it; the eval/<id>.json record
    list_evals(output, run)  /  read_eval(output, run, eval_id)

`evaluate()` is both steps for the CLI. A service (the dashboard's `POST /evals`) calls `plan_eval`,
answers with `plan.eval_id` at once, then runs `run_eval` in the background; `GET /evals/{id}` is
`read_eval`, whose record says "pending", "running", "completed" or "failed".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.procs import dies_with_parent
from dtrain.common.rundir import locate
from dtrain.common.storage import Store, is_remote
from dtrain.control import launchers
from dtrain.control.cluster import Cluster
from dtrain.control.events import Event, Events, Handle, Stop
from dtrain.evaluate import records

MODULE = "dtrain.evaluate"
EVAL_STOP_GRACE_S = 10.0  # an evaluation has nothing to save: after SIGINT/SIGTERM it gets this long
POLL_S = 0.2


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRequest:
    """Which model of which run, and where to work on it, as a user names them."""

    run: str  # run id under the output location, or the run's directory / gs:// URL
    checkpoint: int | None = None  # a checkpoint step; None: the final model
    data_dir: str = ""  # MNIST: where the IDX files are, if not where the run found them
    output: str | None = None  # --output; None: the settings' (or the cluster's bucket)
    cluster: str | None = None  # --cluster; None: the settings' run.cluster ("" : this machine)
    config_path: Path | None = None
    accept_new_host_keys: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRequest(RunRequest):
    prompts: Sequence[str] = ()  # LoRA: prompts to continue
    prompts_file: str = ""  # LoRA: a file (or gs:// object) of prompts, one a line
    data: str = ""  # LoRA: held-out data in the run's format, if not the run's own held-out set
    max_new_tokens: int = 0  # LoRA: tokens sampled per continuation (0: the module's default)
    queue: bool = False  # a Slurm job on the cluster (submit_eval) instead of a process on its master


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportRequest(RunRequest):
    format: str = "onnx"
    copy_to: str = ""  # also copy the model to this local path


@dataclasses.dataclass(frozen=True)
class EvalTarget:
    """Where a run lives and where its evaluation runs."""

    run: Store
    saved: dict[str, Any]  # the run's config.json
    cluster: Cluster | None  # None: this machine
    accept_new_host_keys: bool = False
    config: Any = None  # the cluster's table (a settings.ClusterConfig): where it is started from if stopped

    @property
    def workload(self) -> str:
        return self.saved["workload"]


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    eval_id: str
    target: EvalTarget
    argv: list[str]  # the module's arguments


def resolve(req: RunRequest) -> EvalTarget:
    """The run the request names and the cluster to work on: the one place that turns the CLI's or the
    dashboard's words into a run directory."""
    from dtrain.control import backends
    from dtrain.control.settings import get_cluster, load_settings, run_output

    settings = load_settings(req.config_path, {"run.output": req.output, "run.cluster": req.cluster})
    cfg = get_cluster(settings)
    where = backends.resolve(cfg)
    out = run_output(settings, where)  # a gcp cluster's runs are in its bucket
    run = locate(out, req.run)
    saved = records.run_config(run)
    if launchers.has(where, launchers.Feature.LOCAL):
        return EvalTarget(run, saved, None)
    launchers.require(where, launchers.Feature.EVAL, "dtrain eval --cluster")
    if where.image:
        raise UserError(
            f"cluster {where.name!r} runs jobs in image {where.image}; an evaluation runs in synced mode (the node's "
            "own Python with torch): evaluate on this machine (leave out --cluster), or on a cluster without an image"
        )
    if not is_remote(run.url) and not where.shared_fs:
        raise UserError(
            f"run {run.url} is on this machine, out of reach of cluster {where.name!r}: evaluate it here (leave out "
            f"--cluster), or keep runs in a gs:// bucket (or set shared_fs = true in [clusters.{where.name}])"
        )
    return EvalTarget(run, saved, where, req.accept_new_host_keys, cfg)


def started(target: EvalTarget, *, events: Events, handle: Handle) -> EvalTarget:
    """The target with its cluster started if its backend made it and it is stopped (backends.start_if_stopped,
    as for `dtrain train` and `submit`), and the nodes' addresses that left; after every refusal, before any
    work."""
    from dtrain.control import backends

    if target.cluster is None or not backends.start_if_stopped(target.config, events=events, handle=handle):
        return target
    return dataclasses.replace(target, cluster=backends.resolve(target.config))


def _common_argv(target: EvalTarget, req: RunRequest) -> list[str]:
    checkpoint = req.checkpoint
    if checkpoint is not None:
        if checkpoint < 0:
            raise UserError(f"--checkpoint {checkpoint}: a step is a whole number >= 0")
        records.check_step(target.run, checkpoint)
    argv = [target.run.url]
    if checkpoint is not None:
        argv += ["--checkpoint", str(checkpoint)]
    if req.data_dir:
        argv += ["--data-dir", req.data_dir]
    return argv


def plan_eval(req: EvalRequest) -> EvalPlan:
    """Check the request without running anything (the run, its workload, the checkpoint, the prompts),
    pick the evaluation's id and record it as pending under the run."""
    target = resolve(req)
    if req.queue:
        need_slurm(target)
    from dtrain.control.workloads import WORKLOADS

    evaluable = [name for name, b in WORKLOADS.items() if b.evaluate]
    if target.workload not in evaluable:
        known = ", ".join(evaluable)
        raise UserError(f"run {target.run.url} is a {target.workload} run: dtrain eval knows {known} runs")
    builtin = WORKLOADS[target.workload]
    need_torch_here(target)
    argv = [*_common_argv(target, req), "--evaluator", builtin.evaluate]
    # The file is read here, where the user named it: a job on a cluster gets the prompts, not a path.
    prompts = [*req.prompts, *records.read_prompts(req.prompts_file)]
    given = {"prompts": bool(prompts), "data": bool(req.data), "max_new_tokens": bool(req.max_new_tokens)}
    for option, used in given.items():
        if used and option not in builtin.eval_options:
            takers = [n for n, b in WORKLOADS.items() if option in b.eval_options]
            flag = "--" + option.replace("_", "-")
            raise UserError(f"{flag} is for {' and '.join(takers) or 'no'} runs; {target.run.url} is a "
                            f"{target.workload} run")  # fmt: skip
    if req.data:
        argv += ["--data", req.data]
    if req.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {req.max_new_tokens}: must be >= 0")
    if req.max_new_tokens:
        argv += ["--max-new-tokens", str(req.max_new_tokens)]
    eval_id = records.new_eval_id()
    argv = ["eval", *argv, "--eval-id", eval_id, *(f"--prompt={p}" for p in prompts)]
    records.write_record(
        target.run,
        eval_id,
        {
            "state": "pending",
            "run_id": target.run.url.rstrip("/").rsplit("/", 1)[-1],
            "run": target.run.url,
            "workload": target.workload,
            "step": req.checkpoint,
            "model": "final" if req.checkpoint is None else f"checkpoint step {req.checkpoint}",
            "where": target.cluster.name if target.cluster is not None else "this machine",
            "created": time.time(),
        },
    )
    return EvalPlan(eval_id, target, argv)


def run_eval(plan: EvalPlan, *, events: Events, handle: Handle) -> dict[str, Any]:
    """Run the planned evaluation to its end (its cluster started first if it is stopped); returns its record
    (eval/<id>.json)."""
    try:
        target = started(plan.target, events=events, handle=handle)
        code, error = run_module(target, plan.argv, label=plan.eval_id, events=events, handle=handle)
    except UserError as e:  # it never started (a node out of reach): say so in the record too
        code, error = int(e.exit_code), str(e)
    record = records.read_record(plan.target.run, plan.eval_id) or {}
    if code != 0:
        why = error or (
            "interrupted" if code == ExitCode.INTERRUPTED else f"the evaluation exited with {code}; its output is above"
        )
        if record.get("state") in ("pending", "running", None):  # it could not say so itself (killed, bad input)
            records.write_record(plan.target.run, plan.eval_id, {**record, "state": "failed", "error": why})
        raise UserError(why, exit_code=_exit_code(code))
    return record


def evaluate(req: EvalRequest, *, events: Events, handle: Handle) -> dict[str, Any]:
    """plan_eval, then run_eval: `dtrain eval`."""
    plan = plan_eval(req)
    events.emit("launch", f"evaluating {plan.target.run.url} as {plan.eval_id}", eval_id=plan.eval_id)
    return run_eval(plan, events=events, handle=handle)


def need_slurm(target: EvalTarget) -> None:
    """--queue: the evaluation becomes a job in the cluster's Slurm queue, so there must be one."""
    if target.cluster is None:
        raise UserError("--queue queues the evaluation as a Slurm job on a cluster: name it with --cluster NAME")
    launchers.require(target.cluster, launchers.Feature.QUEUE, "--queue", "leave it out to evaluate on its master")


@dataclasses.dataclass(frozen=True)
class QueuedEval:
    eval_id: str
    job_id: str
    cluster: str
    partition: str
    run_id: str
    url: str  # the run's; the record will be <url>/eval/<eval_id>.json
    workload: str  # the job's: eval:<the run's workload>


def submit_eval(plan: EvalPlan, *, events: Events, handle: Handle | None = None) -> QueuedEval:
    """Queue the planned evaluation as a one-node Slurm job on its cluster (plan_eval with queue=True) and
    return at once with the job id: the job runs the same `python -m dtrain.evaluate eval ...` line as
    run_eval does on the master, so it writes the same record. The job's files are in
    <workdir>/runs/<eval id> on the nodes; `dtrain jobs` shows it as eval:<workload> of the run. A stopped cluster
    is started first."""
    from dtrain.control.slurm.submit import submit_module

    target = plan.target
    need_slurm(target)
    workload = f"eval:{target.workload}"
    run_id = target.run.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        target = started(target, events=events, handle=handle or Handle())
        assert target.cluster is not None
        sub = submit_module(
            target.cluster,
            module=MODULE,
            argv=plan.argv,
            label=plan.eval_id,
            workload=workload,
            run_id=run_id,
            url=target.run.url,
            eval_id=plan.eval_id,
            accept_new_host_keys=target.accept_new_host_keys,
            events=events,
        )
    except UserError as e:  # never queued: say so in the record too
        record = records.read_record(target.run, plan.eval_id) or {}
        records.write_record(target.run, plan.eval_id, {**record, "state": "failed", "error": str(e)})
        raise
    # The record is the job's from now on (it may be running already): the job table links the two.
    return QueuedEval(plan.eval_id, sub.job_id, sub.cluster, sub.partition, run_id, target.run.url, workload)


def queue_eval(req: EvalRequest, *, events: Events, handle: Handle | None = None) -> QueuedEval:
    """plan_eval, then submit_eval: `dtrain eval --queue`."""
    return submit_eval(plan_eval(dataclasses.replace(req, queue=True)), events=events, handle=handle)


def list_evals(output: str, run_ref: str) -> list[dict[str, Any]]:
    """A run's evaluations, newest first."""
    return records.list_records(locate(output, run_ref))


def read_eval(output: str, run_ref: str, eval_id: str) -> dict[str, Any]:
    run = locate(output, run_ref)
    record = records.read_record(run, eval_id)
    if record is None:
        have = ", ".join(r.get("id", "?") for r in records.list_records(run)) or "none"
        raise UserError(f"run {run.url} has no evaluation {eval_id} (its evaluations: {have})")
    return record


# -- export ------------------------------------------------------------------------------------------


def export(req: ExportRequest, *, events: Events, handle: Handle) -> dict[str, Any]:
    """Export the run's model (ONNX for MNIST), checked against torch on its evaluation split; returns
    the check (max_abs_diff, predictions_equal, images, path, ...)."""
    import json

    if req.format != "onnx":
        raise UserError(f"export format {req.format!r}: export supports --onnx only")
    target = resolve(req)
    exporter = _exporter(target)
    need_torch_here(target)
    argv = ["export", *_common_argv(target, req), "--onnx", "--exporter", exporter]
    events.emit("launch", f"exporting {target.run.url} to ONNX")
    target = started(target, events=events, handle=handle)
    code, error = run_module(target, argv, label="export", events=events, handle=handle)
    if code != 0:
        raise UserError(error or f"the export exited with {code}; its output is above", exit_code=_exit_code(code))
    model_path, check_path = records.onnx_paths(req.checkpoint)
    check = json.loads(target.run.read_bytes(check_path))
    if req.copy_to:
        Path(req.copy_to).write_bytes(target.run.read_bytes(model_path))
        check["copied_to"] = str(Path(req.copy_to).resolve())
    return check


def _exporter(target: EvalTarget) -> str:
    """The module that exports `target`'s workload (its registry entry's `export`); one line if it has none."""
    from dtrain.control.workloads import WORKLOADS as table

    b = table.get(target.workload)
    if b is not None and b.export:
        return b.export
    supported = ", ".join(f"{name} runs to ONNX" for name, e in table.items() if e.export) or "no runs"
    note = f" ({b.export_note})" if b is not None and b.export_note else ""
    raise UserError(f"run {target.run.url} is a {target.workload} run{note}: export --onnx supports {supported} only")


# -- running the module ------------------------------------------------------------------------------


def _exit_code(code: int) -> ExitCode:
    try:
        return ExitCode(code)
    except ValueError:
        return ExitCode.FAILURE


class _Lines:
    """The module's output as events, minus its `error:` line, which is kept to be raised as the one
    error line of the command."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.error = ""

    def __call__(self, line: str, **data: Any) -> None:
        if line.startswith("error: "):
            self.error = line.removeprefix("error: ")
        elif data:
            self.events.emit("output", line, **data)
        else:
            self.events.info(line)


def run_module(target: EvalTarget, argv: list[str], *, label: str, events: Events, handle: Handle) -> tuple[int, str]:
    """`python -m dtrain.evaluate ARGV` here or on the cluster's master; returns (exit code, error line)."""
    lines = _Lines(events)
    if target.cluster is None:
        code = _run_here(argv, lines, handle)
    else:
        code = _run_on_master(target, argv, label, lines, events, handle)
    return code, lines.error


def need_torch_here(target: EvalTarget) -> None:
    """An evaluation or export on this machine runs torch here: say what to install before anything starts."""
    if target.cluster is None and importlib.util.find_spec("torch") is None:
        raise UserError(
            f"evaluating on this machine needs torch, which this Python ({sys.executable}) lacks: "
            "pip install 'dtrain[eval]', or evaluate on a cluster with --cluster NAME"
        )


def _run_here(argv: list[str], lines: _Lines, handle: Handle) -> int:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", MODULE, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # our signals reach it only through the handle
        preexec_fn=dies_with_parent(signal.SIGKILL),
    )
    out: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            out.put(raw.decode(errors="replace").rstrip("\r\n"))
        out.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline, done = float("inf"), False
    try:
        while not done or proc.poll() is None:
            for stop in handle.take():
                sig = {Stop.KILL: signal.SIGKILL, Stop.INTERRUPT: signal.SIGINT}.get(stop, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + EVAL_STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            try:
                line = out.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if line is None:
                done = True
            else:
                lines(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    code = proc.returncode
    if code < 0:  # ended by a signal: Ctrl-C's, or ours
        return int(ExitCode.INTERRUPTED) if handle.stopped else int(ExitCode.FAILURE)
    return code


def _run_on_master(
    target: EvalTarget, argv: list[str], label: str, lines: _Lines, events: Events, handle: Handle
) -> int:
    """One process on the cluster's master through its node agent, the code synced there as for training
    (into <workdir>/runs/<label>/code). Not torchrun: one process needs no rendezvous, and the
    rendezvous port may be taken by a training job running there now."""
    from dtrain.control.remote import NodeAgents, NodeWork, code_archive, node_infos, node_spec, sync_code
    from dtrain.control.ssh import SSH

    cluster = dataclasses.replace(target.cluster, nodes=(target.cluster.master,))
    master = cluster.master
    archive, _digest = code_archive()
    with SSH(cluster, accept_new_host_keys=target.accept_new_host_keys) as ssh:
        ssh.connect_all()
        sync_code(ssh, label, archive)
        info = node_infos(ssh, label)[master.name]
        work = NodeWork(tail=[master.python, "-m", MODULE, *argv], torchrun=False)
        spec = node_spec(cluster, master, work, run_id=label, nproc=1, threads=max(1, info.cpus))
        events.emit("stage", f"running on {master.describe()}")

        def relay(ev: Event) -> None:  # the job's lines go through `lines`, which keeps its error line
            if ev.kind == "output":
                lines(ev.message, **ev.data)
            else:
                events.emit(ev.kind, ev.message, **ev.data)

        return NodeAgents(ssh, cluster, label, {master.name: spec}, None, events=Events(relay), handle=handle).run()
