"""dtrain's optional SDK for users' training code: metrics, the checkpoint directory, and stop requests.

    from dtrain import sdk

    ckpt = sdk.checkpoint_dir() / "last.pt"  # copied to the run's store; survives a restart
    state = torch.load(ckpt) if ckpt.exists() else {"step": 0}
    sdk.install_sigterm_flag()  # SIGTERM no longer kills: stop_requested() turns True instead
    for step in range(state["step"], total_steps):
        loss = train_step(model, next(batches))
        sdk.log(step, loss=loss, lr=scheduler.get_last_lr()[0])  # metrics from rank 0; a heartbeat on every rank
        if sdk.stop_requested():  # preemption notice, `dtrain cancel`, SIGTERM
            if sdk.is_main_process():
                torch.save({"step": step + 1, "model": model.state_dict()}, ckpt)
            break

Every function is harmless outside dtrain: `log` does nothing, `checkpoint_dir` is ./checkpoints,
`stop_requested` is False (unless SIGTERM arrived after `install_sigterm_flag`), the ranks are 0. The
variables read are dtrain.common.jobenv's, plus torchrun's RANK. Standard library only, so a project
can depend on it without pulling anything in.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, SupportsFloat

from dtrain.common import jobenv

__all__ = [
    "checkpoint_dir",
    "checkpoint_saved",
    "in_dtrain",
    "install_sigterm_flag",
    "is_main_process",
    "log",
    "node_rank",
    "restart_count",
    "run_id",
    "stop_requested",
]

# stop_requested() looks at the stop file at most this often, so calling it every step costs nothing.
STOP_CHECK_EVERY_S = 0.5
DEFAULT_CHECKPOINT_DIR = "checkpoints"
BEAT_EVERY_S = 1.0  # the heartbeat file is rewritten at most this often

_warned_io = False
_sigterm_received = False
_stop_seen = False
_stop_checked_at = -math.inf
_beat_at = -math.inf
_trackers: Any = None  # dtrain.common.trackers.Trackers once log() opened them; False if that failed


def in_dtrain() -> bool:
    """True in a job that dtrain started."""
    return bool(os.environ.get(jobenv.RUN))


def run_id() -> str | None:
    """The run's id, or None outside dtrain."""
    return os.environ.get(jobenv.RUN) or None


def restart_count() -> int:
    """0 on a run's first start, then one more per relaunch, requeue or resume."""
    return _int_env(jobenv.RESTART_COUNT)


def node_rank() -> int:
    """This node's index in the job (0 outside dtrain)."""
    return _int_env(jobenv.NODE_RANK)


def is_main_process() -> bool:
    """True on the job's global rank 0 (torchrun's RANK), and in a process torchrun did not start."""
    return os.environ.get("RANK", "0") in ("", "0")


def log(step: int | None = None, **metrics: SupportsFloat) -> None:
    """Appends `{"step": step, "time": <unix time>, **metrics}` as one JSON line to the run's metrics,
    on the main process only; does nothing outside dtrain. With a step and the run's `tracker` setting
    (DTRAIN_TRACKER=mlflow,wandb), the same values also go to those trackers (docs/trackers.md).
    With a step, on every rank, it is also the rank's heartbeat: dtrain takes a rank whose step stops
    moving for the hang timeout for hung (docs/hangs.md), so call it on every rank, every step or every few.

    Values are numbers: Python numbers, numpy scalars or 0-d tensors (anything float() takes).
    A non-finite value (NaN, inf) is written as null. A value that is not a number raises ValueError;
    a failed write warns once on stderr and never raises."""
    if step is not None:
        _beat(int(step))
    path = os.environ.get(jobenv.METRICS_FILE)
    if not path or not is_main_process():
        return
    record: dict[str, Any] = {"step": None if step is None else int(step), "time": time.time()}
    for name, value in metrics.items():
        record[name] = _number(name, value)
    line = json.dumps(record, allow_nan=False) + "\n"
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
    except OSError as e:
        _warn_once(f"dtrain.sdk: cannot write metrics to {path} ({e.strerror or e}); metrics are not recorded")
    if step is not None and os.environ.get(jobenv.TRACKERS):
        _track(int(step), {k: v for k, v in record.items() if k not in ("step", "time") and v is not None})


def _track(step: int, metrics: dict[str, Any]) -> None:
    """The metrics to the trackers the run was given (DTRAIN_TRACKERS: MLflow, W&B; docs/trackers.md), opened
    at the first call. Their run ids are kept in the checkpoint directory's trackers.json, which dtrain copies
    with the checkpoints and puts back on a resume, so a resumed job goes on in the same tracker runs. Never
    raises: a tracker that cannot be used is one warning (dtrain.common.trackers)."""
    global _trackers
    if _trackers is None:
        _trackers = False  # one try per process
        try:
            _trackers = _open_trackers()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            print(f"warning: dtrain.sdk: trackers not started ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    if _trackers:
        _trackers.log(step, metrics)


def _open_trackers() -> Any:
    import atexit

    from dtrain.common.choices import Tracker
    from dtrain.common.storage import open_store
    from dtrain.common.trackers import Where, open_trackers

    def warn(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    kinds = []
    for name in os.environ.get(jobenv.TRACKERS, "").split(","):
        if name.strip():
            try:
                kinds.append(Tracker(name.strip()))
            except ValueError:
                warn(f"warning: dtrain.sdk: unknown tracker {name.strip()!r} in {jobenv.TRACKERS}; left out")
    where = Where(run_id() or "", os.environ.get(jobenv.RUN_URL, ""), "program", os.getcwd())
    trackers = open_trackers(kinds, record=open_store(str(checkpoint_dir())), where=where, params={}, warn=warn)

    def close() -> None:
        # An uncaught exception left sys.last_value (the default excepthook sets it before exit handlers run).
        failed = getattr(sys, "last_value", None) is not None
        try:
            trackers.close("failed" if failed else "stopped" if stop_requested() else "completed")
        except Exception as e:  # noqa: BLE001 - the program's exit is not the trackers' to spoil
            warn(f"warning: dtrain.sdk: trackers not closed ({type(e).__name__}: {e})")

    atexit.register(close)
    return trackers


def checkpoint_dir() -> Path:
    """The directory to save checkpoints in (created): dtrain's per-node directory, copied to the run's
    store, or ./checkpoints outside dtrain."""
    path = Path(os.environ.get(jobenv.CHECKPOINT_DIR) or DEFAULT_CHECKPOINT_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_saved(path: str | os.PathLike[str]) -> None:
    """Says that the checkpoint at `path` (a file or a folder under checkpoint_dir()), just written and closed,
    is whole. dtrain then copies it to the run within seconds, whatever else in the directory is still
    changing, instead of waiting for the directory to settle (docs/user-code.md). What is recorded is each
    file's size and mtime as they are now, so a later change to them makes the checkpoint not whole again
    until it is marked again. Call it from the process that saved; harmless outside dtrain."""
    import fcntl

    from dtrain.common.mirror import SDK_MARKER, is_temporary

    root = checkpoint_dir().resolve()
    target = Path(path).resolve()
    try:
        rel = target.relative_to(root).as_posix()
    except ValueError:
        raise ValueError(f"checkpoint_saved: {path} is not under the checkpoint directory {root}") from None
    if rel == "." or not target.exists():
        raise ValueError(f"checkpoint_saved: {path} is not a file or folder under {root}")
    paths = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
    files = {}
    for p in paths:
        name = p.relative_to(root).as_posix()
        if not any(is_temporary(part) for part in name.split("/")):
            st = p.stat()
            files[name] = [st.st_size, st.st_mtime_ns]
    marker = root / SDK_MARKER
    with open(root / f"{SDK_MARKER}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time: each keeps the others' checkpoints
        try:
            units = json.loads(marker.read_text())["units"]
        except (OSError, ValueError, KeyError, TypeError):
            units = {}
        units = {p: f for p, f in units.items() if (root / p).exists()}  # a removed checkpoint says nothing
        units[rel] = files
        tmp = root / f"{SDK_MARKER}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"units": units}))
        os.replace(tmp, marker)


def stop_requested() -> bool:
    """True once dtrain has asked the job to stop (a preemption notice, a cancel, a SIGTERM to the
    job), or this process got SIGTERM after install_sigterm_flag(). Stays True. Cheap to call every
    step: the stop file is looked at every STOP_CHECK_EVERY_S at most."""
    global _stop_seen, _stop_checked_at
    if _sigterm_received or _stop_seen:
        return True
    path = os.environ.get(jobenv.STOP_FILE)
    if not path:
        return False
    now = time.monotonic()
    if now - _stop_checked_at >= STOP_CHECK_EVERY_S:
        _stop_checked_at = now
        _stop_seen = os.path.exists(path)
    return _stop_seen


def install_sigterm_flag() -> None:
    """Makes SIGTERM set the flag stop_requested() reads, instead of ending the process, so the loop
    can save a checkpoint first. A Python handler installed before is still called. Call it from the
    main thread (Python's rule for signal handlers)."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        global _sigterm_received
        _sigterm_received = True
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def _beat(step: int) -> None:
    """This rank's heartbeat file, rewritten at most once a second (dtrain.common.progress.Heartbeat's format,
    repeated here: the SDK imports nothing but the names of dtrain's variables)."""
    global _beat_at
    directory = os.environ.get(jobenv.PROGRESS_DIR)
    now = time.monotonic()
    if not directory or now - _beat_at < BEAT_EVERY_S:
        return
    _beat_at = now
    path = os.path.join(directory, f"rank-{os.environ.get('RANK') or '0'}")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{step} {time.time():.3f}\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a heartbeat must never stop training


def _number(name: str, value: SupportsFloat) -> float | int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = float(value)  # 0-d tensors and numpy scalars convert themselves
    except (TypeError, ValueError):
        raise ValueError(f"dtrain.sdk.log: {name}={value!r} is not a number") from None
    return number if math.isfinite(number) else None


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name) or 0)
    except ValueError:
        return 0


def _warn_once(message: str) -> None:
    global _warned_io
    if not _warned_io:
        _warned_io = True
        print(message, file=sys.stderr, flush=True)
