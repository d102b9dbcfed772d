"""The harness around a workload's training function: flags -> config, process group, run
directory, checkpointer, reporter, preemption, and the mapping from outcomes to exit codes.

    def main(argv=None):
        run_workload("mnist", MnistConfig, train, argv)   # never returns

`train(ctx)` returns a dict of final figures (saved in status.json). It raises UserError for
input the user must fix, Preempted after a SIGTERM checkpoint; anything else is a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from dtrain.common import config as cfgmod
from dtrain.common import env as envmod
from dtrain.common import jobenv, runrecord
from dtrain.common.checkpoint import Checkpointer
from dtrain.common.dist import Dist, PeerFailure, distributed, is_comm_failure
from dtrain.common.errors import ExitCode, Preempted, UserError
from dtrain.common.metrics import Reporter, print_error, record_event
from dtrain.common.precision import PrecisionPolicy, device_name, resolve_precision, restore_scaler
from dtrain.common.preempt import PreemptionPoll, PreemptionWatch
from dtrain.common.progress import beat
from dtrain.common.rundir import (
    CHECKPOINTS,
    RUN_ID_RE,
    config_diff,
    locate,
    new_run_id,
    read_json,
    run_disk_full,
    run_location,
    write_json,
)
from dtrain.common.storage import DiskFull, Store, is_remote, open_store

C = TypeVar("C")


@dataclasses.dataclass
class Context:
    workload: str
    cfg: Any
    d: Dist
    run: Store
    run_id: str
    resuming: bool
    report: Reporter
    precision: PrecisionPolicy
    ckpt: Checkpointer
    preempt: PreemptionWatch
    poll: PreemptionPoll

    def restore_scaler(self, scaler: Any, state: dict[str, Any], step: int) -> None:
        """The checkpoint's loss-scaler state into `scaler`; a change of precision since the
        checkpoint is kept in the run's metrics as an event (precision is not part of the model
        config: the same weights train on a T4 in fp16 and on an L4 in bf16)."""
        change = restore_scaler(scaler, state, self.precision.mode)
        if change:
            self.report.event(step, "precision", change, precision=self.precision.mode.value)

    def stop_requested(self, step: int) -> bool:
        """True on every rank, at the same step, once any rank got SIGTERM. Call after every step;
        the ranks agree on it about once a second (PreemptionPoll). Also this rank's heartbeat (hang detection)."""
        beat(step)
        return self.poll(step)


def resolve_config(workload: str, cls: type[C], argv: Sequence[str] | None) -> tuple[C, Store | None]:
    """Flags over (on resume) the run's saved config over defaults. Returns the config and, when
    resuming, the run directory."""
    explicit = cfgmod.parse_explicit(
        cls,
        argv,
        prog=f"python -m dtrain.{workload}.train",
        description=f"dtrain {workload} workload (run it under torchrun)",
    )
    resume = explicit.get("resume", "")
    if not resume:
        return cfgmod.build(cls, explicit), None
    output = explicit.get("output", cfgmod.RunConfig().output)
    run = locate(output, resume)
    saved = read_json(run, "config.json") or {}
    if saved.get("workload", workload) != workload:
        raise UserError(f"run {run.url} is a {saved['workload']} run, not {workload}")
    base = {k: v for k, v in (saved.get("config") or {}).items() if k not in cfgmod.PLACEMENT_KEYS}
    return cfgmod.build(cls, {**base, **explicit}), run


def run_workload(
    workload: str, cls: type[C], train: Callable[[Context], dict[str, Any]], argv: Sequence[str] | None = None
) -> NoReturn:
    sys.exit(int(_run(workload, cls, train, argv)))


def _run(workload: str, cls: type, train: Callable[[Context], dict[str, Any]], argv: Sequence[str] | None) -> ExitCode:
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg, resumed_run = resolve_config(workload, cls, argv)
    except UserError as e:
        if rank == 0:
            print_error(str(e))
        return e.exit_code

    run: Store | None = None
    d: Dist | None = None
    ctx: Context | None = None
    try:
        with distributed(cfg.run.backend, cfg.run.dist_timeout) as d:
            run, run_id, resuming = _open_run(workload, cfg, d, resumed_run)
            ctx = _context(workload, cfg, d, run, run_id, resuming=resuming)
            try:
                with ctx.preempt:
                    result = train(ctx)
                ctx.poll.close()
                ctx.ckpt.close()
            finally:
                ctx.report.close()
            if d.is_main:  # before the status, so a completed run has its picture
                _curves(run, ctx.report)
            _status(d, run, "completed", ExitCode.OK, ctx, result=result)
            return ExitCode.OK
    except UserError as e:
        if rank == 0:
            print_error(str(e))
        if e.exit_code == ExitCode.USAGE and resumed_run is None and _nothing_to_keep(d, run):
            # A fresh run stopped by bad input before any checkpoint: no debris. A runtime failure
            # (a full disk, a NaN loss) keeps its run, so the `--resume` the launcher suggests finds it.
            run.delete("")
        else:
            _status(d, run, "failed", e.exit_code, ctx, error=str(e))
        return e.exit_code
    except Preempted:
        if rank == 0:
            print_error(
                "preempted (SIGTERM): checkpoint saved; resume with "
                f"`dtrain train {workload} --resume {run.url if run else '<run>'}`"
            )
        _status(d, run, "preempted", ExitCode.PREEMPTED, ctx)
        return ExitCode.PREEMPTED
    except KeyboardInterrupt:
        _status(d, run, "interrupted", ExitCode.INTERRUPTED, ctx)
        return ExitCode.INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every other failure is reported and mapped to FAILURE
        if d is not None and is_comm_failure(e):
            print_error(d.describe_failure(e))
        else:
            traceback.print_exc()
        _status(d, run, "failed", ExitCode.FAILURE, ctx, error=f"{type(e).__name__}: {e}")
        return ExitCode.FAILURE


def _open_run(workload: str, cfg: Any, d: Dist, resumed: Store | None) -> tuple[Store, str, bool]:
    """The run directory, its id, and whether this continues it. Workers that torchrun restarted
    after a failure (--max-restarts) continue the run they were started for, from its last
    complete checkpoint, as if resumed."""
    if resumed is not None:
        run = resumed
        run_id = run.url.rstrip("/").rsplit("/", 1)[-1]
    else:
        if cfg.run.run_dir:  # the launcher's: where this run lives was worked out once, there
            run = open_store(cfg.run.run_dir)
            run_id = run.url.rstrip("/").rsplit("/", 1)[-1]
        else:  # a plain torchrun: every rank must agree on one new id
            run_id = cfg.run.run_id or (d.env.run_id if RUN_ID_RE.match(d.env.run_id) else "")
            run_id, run = run_location(workload, cfg.run.output, run_id or d.broadcast(new_run_id(workload)))
        if (d.env.restart_count > 0 or _relaunched(run)) and d.broadcast(
            run.exists("config.json") if d.is_main else None
        ):
            resumed = run

    def prepare() -> None:
        run.check_writable()
        saved = read_json(run, "config.json") if resumed else None
        if not resumed and run.exists("config.json"):
            raise UserError(
                f"run {run.url} already exists: continue it with --resume {run_id}, or pick another --run-id"
            )
        if saved and saved.get("model_config") not in (None, cfg.model_config()):
            # Refuse before touching the run: its status and config stay as they were.
            raise UserError(
                f"run {run.url} was trained with a different model config "
                f"({config_diff(saved['model_config'], cfg.model_config(), 'the run')}): resume with the run's own "
                "model settings, or start a new run without --resume"
            )
        record = saved or {
            "workload": workload,
            "run_id": run_id,
            "created": time.time(),
            "config": cfgmod.flatten(cfg),
            "model_config": cfg.model_config(),
        }
        if resumed:
            record.setdefault("resumes", []).append({"time": time.time(), "config": cfgmod.flatten(cfg)})
        record["world_size"] = d.world_size
        peers = [dataclasses.asdict(p) for p in d.peers] or [{"rank": 0, "host": d.env.hostname, "pid": os.getpid()}]
        status = {"state": "running", "exit_code": None, "updated": time.time(), "pid": os.getpid(),
                  "host": d.env.hostname, "peers": peers}  # fmt: skip
        if _launched(run):
            # dtrain's launcher recorded the start (its pid and host: the process that records the end, which
            # `dtrain runs` checks is alive; the starts so far) and keeps what this adds.
            before = runrecord.read_status(run) or {}
            status = {**{k: v for k, v in before.items() if k not in ("exit_code", "error")}, **status,
                      **{k: before[k] for k in ("pid", "host") if before.get(k)}}  # fmt: skip
        try:
            write_json(run, "config.json", record)
            runrecord.write_status(run, status)
        except DiskFull as e:  # one line, as a checkpoint save that fills the disk gives
            raise run_disk_full(e, run_id, resumed=resumed is not None) from None

    _on_main_then_share(d, prepare)
    return run, run_id, resumed is not None


def _launched(run: Store) -> bool:
    """dtrain's launcher started this job for this run (it gave the job dtrain's variables: dtrain.common.jobenv)."""
    return os.environ.get(jobenv.RUN_URL, "").rstrip("/") == run.url.rstrip("/")


def _relaunched(run: Store) -> bool:
    """dtrain's launcher started this run's job again (after a failure on a node: DTRAIN_RESTART_COUNT)."""
    if not _launched(run):
        return False
    try:
        return int(os.environ.get(jobenv.RESTART_COUNT) or 0) > 0
    except ValueError:
        return False


def _on_main_then_share(d: Dist, fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0; if it raises UserError, raise the same error on every rank, so all
    ranks exit with the same code instead of the others timing out."""
    outcome: tuple[str, int] | None = None
    if d.is_main:
        try:
            fn()
        except UserError as e:
            outcome = (str(e), int(e.exit_code))
    outcome = d.broadcast(outcome)
    if outcome is not None:
        raise UserError(outcome[0], exit_code=ExitCode(outcome[1]))


def _context(workload: str, cfg: Any, d: Dist, run: Store, run_id: str, *, resuming: bool) -> Context:
    # TensorBoard writes to files it keeps open and appends to: in the run's directory when that is
    # local, else on this machine, copied up with the metrics (Reporter).
    remote = is_remote(run.url)
    report = Reporter(
        enabled=d.is_main,
        store=run,
        resume=resuming,
        tb_dir=str(envmod.cache_dir() / "tensorboard" / run_id) if remote else os.path.join(run.url, "tensorboard"),
        tb_sync=run.child("tensorboard") if remote else None,
    )
    if d.is_main and cfg.run.tracker:
        from dtrain.common.trackers import for_run, open_trackers

        report.trackers = open_trackers(cfg.run.tracker, record=run, where=for_run(run, run_id, workload),
                                        params=cfgmod.flatten(cfg), warn=report.info)  # fmt: skip
    precision = resolve_precision(cfg.run.precision, d.device)
    precision.configure()
    ifnames = "".join(f", {k}={v}" for k, v in d.env.socket_ifnames.items())
    report.info(f"[bold]{workload}[/] run [cyan]{run_id}[/] -> {run.url}")
    report.info(
        f"{d.world_size} process(es), backend {d.backend or 'none (single process)'}, "
        f"device {device_name(d.device)}, precision {precision.describe()}{ifnames}"
    )
    ckpt = Checkpointer(
        checkpoint_store(run),
        d,
        every=cfg.run.checkpoint_every,
        keep=cfg.run.keep_checkpoints,
        model_config=cfg.model_config(),
        run_config=cfgmod.flatten(cfg),
        log=report.info,
        before_save=report.flush,
        on_event=report.event,
    )
    if not resuming:  # a resume says so, with its step, when the checkpoint is loaded
        hosts = sorted({p.host for p in d.peers}) or [d.env.hostname]
        report.event(0, "started", f"started on {d.world_size} process(es)", world_size=d.world_size, hosts=hosts)
    watch = PreemptionWatch()
    return Context(workload, cfg, d, run, run_id, resuming, report, precision, ckpt, watch, PreemptionPoll(d, watch))


def checkpoint_store(run: Store) -> Store:
    """Where this run's checkpoints go: the checkpoint directory dtrain's launcher gave the job
    (DTRAIN_CHECKPOINT_DIR, a local folder on each node that the launcher copies to the run and puts back
    before a restart or resume: dtrain.common.mirror), as for any user's program; under a plain torchrun (or
    in a job launched for another run) the run's own checkpoints/, as also for a run whose checkpoints are
    already there (one a previous dtrain wrote in place): it goes on where they are."""
    given = os.environ.get(jobenv.CHECKPOINT_DIR)
    in_place = run.child(CHECKPOINTS)
    if given and _launched(run):
        store = open_store(given)
        if store.url.rstrip("/") == in_place.url.rstrip("/") or store.list("") or not in_place.list(""):
            return store
    return in_place


def _curves(run: Store, report: Reporter) -> None:
    """final/curves.png, best effort: a run that trained is not failed by its picture."""
    try:
        from dtrain.evaluate.curves import write_run_curves

        write_run_curves(run)
    except Exception as e:  # noqa: BLE001 - matplotlib missing, a full disk: say so and go on
        report.info(f"final/curves.png not written: {e}")


def _nothing_to_keep(d: Dist | None, run: Store | None) -> bool:
    if run is None or d is None or not d.is_main:
        return False
    try:
        return not checkpoint_store(run).list("") and not run.exists("final/model.json")
    except Exception:  # noqa: BLE001 - if we cannot even list it, leave it alone
        return False


def _status(d: Dist | None, run: Store | None, state: str, code: ExitCode, ctx: Context | None, **extra: Any) -> None:
    """Record how the run ended (rank 0). Best effort: the exit code is what counts."""
    if run is None or (d is not None and not d.is_main):
        return
    step = None
    if ctx is not None:
        with contextlib.suppress(Exception):
            ctx.ckpt.close()
        step = ctx.ckpt.last_saved_step
    message = {"completed": "completed", "preempted": "preempted (SIGTERM): checkpoint saved"}.get(
        state, f"{state} (exit {int(code)})" + (f": {extra['error']}" if extra.get("error") else "")
    )
    # Under dtrain's launcher a stop is labelled by the launcher, which knows why it stopped the job (a
    # preemption, a time limit, a hang): one label per stop (dtrain.common.runrecord); alone, the run labels it.
    # A rank that fails once SIGTERM came (its peer stopped for a hang, say) fails of that stop: the same label.
    stopped = state == runrecord.PREEMPTED or (state == runrecord.FAILED and ctx is not None and ctx.preempt.requested)
    if not (stopped and _launched(run)):
        record_event(run, step, state, message, exit_code=int(code))
    with contextlib.suppress(Exception):
        runrecord.update_status(run, {"state": state, "exit_code": int(code), **extra})


__all__ = ["Context", "PeerFailure", "run_workload", "resolve_config"]
