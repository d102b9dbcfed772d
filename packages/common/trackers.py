"""Experiment trackers for dtrain's own workloads: MLflow and Weights & Biases, as options (`--tracker
mlflow,wandb`, `[run] tracker`, DTRAIN_TRACKER). Rank 0 only: the Reporter (dtrain.common.metrics) owns them.

Each tracker is configured the way its own library is, from the environment (MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME, WANDB_MODE, WANDB_PROJECT, WANDB_DIR, their API keys ...), which dtrain's launchers
pass through to every node (dtrain.common.jobenv.TRACKER_ENV). The tracker's own run id is kept in the run's
trackers.json, so a resumed run (or a relaunch) goes on logging into the same tracker run.

A tracker is never a reason for a run to fail: one that is not installed, not configured or not reachable is
one warning line, and the run trains on without it (metrics.jsonl has everything). The libraries are imported
here only when a tracker is asked for.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from dtrain.common.choices import Tracker
from dtrain.common.rundir import read_json, write_json
from dtrain.common.storage import Store, is_remote

RECORD = "trackers.json"  # in the run: {"mlflow": {"run_id", "experiment_id", "tracking_uri"}, "wandb": {...}}
PROBE_TIMEOUT_S = 5.0  # how long the start waits to learn that an MLflow server is not there
CLOSE_S = 30.0  # the most the run's end waits for one tracker to end its run (Trackers.close)
DEFAULT_EXPERIMENT = "dtrain"  # MLflow's experiment and W&B's project when the environment names none
INSTALL_HINT = "pip install 'dtrain[trackers]'"

Warn = Callable[[str], None]


class _Tracker:
    name = ""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, state: str) -> None: ...


class _MLflow(_Tracker):
    """One MLflow run per dtrain run, through MlflowClient rather than mlflow's fluent API, so a program that also
    calls `mlflow.start_run()` itself (through the SDK) keeps its own active run."""

    name = "mlflow"

    def __init__(self, where: Where, params: Mapping[str, Any], saved: dict | None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            raise _Unusable("MLFLOW_TRACKING_URI is not set (the tracking server's URL, e.g. http://host:5000)")
        if uri.startswith(("http://", "https://")):
            _probe(uri)
        self._client = client = MlflowClient(uri)
        if saved and saved.get("run_id"):  # a resume: the same MLflow run, RUNNING again
            self.run_id = saved["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            experiment_id = client.get_run(self.run_id).info.experiment_id
        else:
            experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or _experiment(
                client, os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            )
            tags = {"dtrain.run_id": where.run_id, "dtrain.run_url": where.run_url, "dtrain.workload": where.workload}
            self.run_id = client.create_run(experiment_id, run_name=where.run_id, tags=tags).info.run_id
            if params:
                from mlflow.entities import Param

                client.log_batch(self.run_id, params=[Param(k, _param(v)) for k, v in params.items()])
        self.record = {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri}
        # Metrics go out from a thread of their own, in order, so a slow or lost server never holds a training
        # step up; close() waits for them. (MlflowClient's synchronous=False queue is the fluent API's to flush.)
        self._queue: queue.Queue[list[Any] | None] = queue.Queue()
        self._error: Exception | None = None
        self._sender = threading.Thread(target=self._send, name="mlflow-log", daemon=True)
        self._sender.start()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self._error is not None:
            raise self._error
        now = int(time.time() * 1000)
        self._queue.put([Metric(k, v, now, step) for k, v in values.items()])

    def _send(self) -> None:
        """The sender thread: each batch in order, until close()'s None; the first failure stops it and is raised
        by the next log() (Trackers then drops this tracker with a warning)."""
        while (metrics := self._queue.get()) is not None:
            try:
                self._client.log_batch(self.run_id, metrics=metrics)
            except Exception as e:  # noqa: BLE001 - reported by log() or close()
                self._error = e
                return

    def close(self, state: str) -> None:
        self._queue.put(None)
        self._sender.join()  # every batch sent first (Trackers.close bounds the wait)
        status = {"completed": "FINISHED", "failed": "FAILED"}.get(state, "KILLED")
        self._client.set_terminated(self.run_id, status=status)
        if self._error is not None:
            raise self._error


def _experiment(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


class _Wandb(_Tracker):
    """One W&B run per dtrain run, its x axis dtrain's step (W&B's own step must only grow, and a resumed run
    logs the steps after its checkpoint again)."""

    name = "wandb"

    def __init__(self, where: Where, params: Mapping[str, Any], saved: dict | None):
        import wandb

        directory = os.environ.get("WANDB_DIR") or where.files_dir
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
            dir=directory,
            name=where.run_id,
            id=(saved or {}).get("id") or None,
            resume="allow" if saved else None,
            config=dict(params),
            tags=[where.workload],
            reinit="create_new",
        )
        self._run.define_metric("*", step_metric="step")
        self.record = {"id": self._run.id, "project": self._run.project, "dir": directory}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log({"step": step, **values})

    def close(self, state: str) -> None:
        self._run.finish(exit_code=0 if state == "completed" else 1)


_KINDS: dict[Tracker, type[_Tracker]] = {Tracker.MLFLOW: _MLflow, Tracker.WANDB: _Wandb}
_MODULES = {Tracker.MLFLOW: "mlflow", Tracker.WANDB: "wandb"}


class _Unusable(Exception):
    """A tracker that cannot be used for this run: the reason, for one warning line."""


class Trackers:
    """The trackers of one run (rank 0). Every call is best effort: a tracker that fails is dropped with one
    warning, and the run goes on."""

    def __init__(self, trackers: list[_Tracker], warn: Warn) -> None:
        self._trackers = trackers
        self._warn = warn

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._trackers]

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self._each("log", lambda t: t.log(step, numbers))

    def close(self, state: str) -> None:
        """End each tracker's run, each given at most CLOSE_S: MLflow's end waits for its queued metrics, which
        a server that went away mid-run would keep for minutes of retries."""
        for t in list(self._trackers):
            closer = threading.Thread(target=self._each_of, args=([t], "close", lambda t: t.close(state)),
                                      name=f"{t.name}-close", daemon=True)  # fmt: skip
            closer.start()
            closer.join(CLOSE_S)
            if closer.is_alive():
                self._warn(f"warning: {t.name}: its run did not end within {CLOSE_S:.0f} s; its last metrics may be "
                           "missing there (metrics.jsonl has them all)")  # fmt: skip
        self._trackers = []

    def _each(self, what: str, call: Callable[[_Tracker], None]) -> None:
        self._each_of(self._trackers, what, call)

    def _each_of(self, trackers: list[_Tracker], what: str, call: Callable[[_Tracker], None]) -> None:
        for t in list(trackers):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - a tracker never fails the run
                self._warn(f"warning: {t.name}: {what} failed ({_one_line(e)}); no more {t.name} logging in this run")
                if t in self._trackers:
                    self._trackers.remove(t)


@dataclasses.dataclass(frozen=True)
class Where:
    """What the trackers' runs are named after, and where W&B's files go unless WANDB_DIR says."""

    run_id: str
    run_url: str
    workload: str
    files_dir: str


def for_run(run: Store, run_id: str, workload: str) -> Where:
    """A built-in's: W&B's files in the run's own folder when it is on this disk, else in this machine's cache."""
    if is_remote(run.url):
        from dtrain.common import env as envmod

        return Where(run_id, run.url, workload, str(envmod.cache_dir() / "wandb" / run_id))
    return Where(run_id, run.url, workload, run.url)


def open_trackers(
    kinds: list[Tracker], *, record: Store, where: Where, params: Mapping[str, Any], warn: Warn
) -> Trackers:
    """The trackers asked for, each started (or, when `record`'s trackers.json names its run, resumed), and their
    run ids written to that trackers.json. One that cannot start is a warning and is left out."""
    saved = (read_json(record, RECORD) or {}) if kinds else {}
    started: list[_Tracker] = []
    for kind in dict.fromkeys(kinds):
        try:
            tracker = _start(kind, where, params, saved.get(kind.value))
        except _Unusable as e:
            warn(f"warning: {kind.value}: {e}; training goes on without it")
            continue
        except Exception as e:  # noqa: BLE001 - the library's own failure (a refused key, a server error)
            warn(f"warning: {kind.value}: could not start its run ({_one_line(e)}); training goes on without it")
            continue
        started.append(tracker)
        saved[kind.value] = tracker.record  # type: ignore[attr-defined]
    if started:
        try:
            write_json(record, RECORD, saved)
        except Exception as e:  # noqa: BLE001 - a resume would then start new tracker runs: say so
            warn(f"warning: {RECORD} not written ({_one_line(e)}); a resume will start new tracker runs")
    return Trackers(started, warn)


def _start(kind: Tracker, where: Where, params: Mapping[str, Any], saved: dict | None) -> _Tracker:
    try:
        __import__(_MODULES[kind])
    except ImportError:
        raise _Unusable(f"{_MODULES[kind]} is not installed ({INSTALL_HINT})") from None
    return _KINDS[kind](where, params, saved)


def _probe(uri: str) -> None:
    """Raise _Unusable unless an MLflow server answers at `uri` within PROBE_TIMEOUT_S: MLflow's own client
    retries a refused connection for minutes before it gives up."""
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):  # noqa: S310 - the user's own server
            return
    except urllib.error.HTTPError:
        return  # something answers: MLflow's client says what, if it is not a tracking server
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise _Unusable(f"no tracking server answers at {uri} ({reason})") from None


def _param(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text[:500]  # MLflow's limit on a param value


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


__all__ = ["RECORD", "Trackers", "Where", "for_run", "open_trackers"]
