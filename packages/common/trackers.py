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

import os
import threading
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
    """One MLflow run per dtrain run. Metrics go through MLflow's asynchronous logging, so a slow or lost
    server never holds a training step up."""

    name = "mlflow"

    def __init__(self, run: Store, run_id: str, workload: str, params: Mapping[str, Any], saved: dict | None):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            raise _Unusable("MLFLOW_TRACKING_URI is not set (the tracking server's URL, e.g. http://host:5000)")
        if uri.startswith(("http://", "https://")):
            _probe(uri)
        self._mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        if saved and saved.get("run_id"):  # a resume: the same MLflow run, RUNNING again
            active = mlflow.start_run(run_id=saved["run_id"])
        else:
            if not os.environ.get("MLFLOW_EXPERIMENT_ID"):
                mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT)
            active = mlflow.start_run(
                run_name=run_id, tags={"dtrain.run_id": run_id, "dtrain.run_url": run.url, "dtrain.workload": workload}
            )
            mlflow.log_params({k: _param(v) for k, v in params.items()})
        self.record = {"run_id": active.info.run_id, "experiment_id": active.info.experiment_id, "tracking_uri": uri}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(values), step=step, synchronous=False)

    def close(self, state: str) -> None:
        status = {"completed": "FINISHED", "failed": "FAILED"}.get(state, "KILLED")
        self._mlflow.end_run(status=status)


class _Wandb(_Tracker):
    """One W&B run per dtrain run, its x axis dtrain's step (W&B's own step must only grow, and a resumed run
    logs the steps after its checkpoint again)."""

    name = "wandb"

    def __init__(self, run: Store, run_id: str, workload: str, params: Mapping[str, Any], saved: dict | None):
        import wandb

        # WANDB_DIR wins; else the run's own folder when it is on this disk, else this machine's cache.
        if os.environ.get("WANDB_DIR"):
            directory = os.environ["WANDB_DIR"]
        elif is_remote(run.url):
            from dtrain.common import env as envmod

            directory = str(envmod.cache_dir() / "wandb" / run_id)
        else:
            directory = run.url
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
            dir=directory,
            name=run_id,
            id=(saved or {}).get("id") or None,
            resume="allow" if saved else None,
            config=dict(params),
            tags=[workload],
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


def open_trackers(
    kinds: list[Tracker], *, run: Store, run_id: str, workload: str, params: Mapping[str, Any], warn: Warn
) -> Trackers:
    """The trackers asked for, each started (or, when the run's trackers.json names its run, resumed), and their
    run ids written to trackers.json. One that cannot start is a warning and is left out."""
    saved = (read_json(run, RECORD) or {}) if kinds else {}
    started: list[_Tracker] = []
    for kind in dict.fromkeys(kinds):
        try:
            tracker = _start(kind, run, run_id, workload, params, saved.get(kind.value))
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
            write_json(run, RECORD, saved)
        except Exception as e:  # noqa: BLE001 - a resume would then start new tracker runs: say so
            warn(f"warning: {RECORD} not written ({_one_line(e)}); a resume will start new tracker runs")
    return Trackers(started, warn)


def _start(kind: Tracker, run: Store, run_id: str, workload: str, params: Mapping[str, Any], saved: dict | None):
    try:
        __import__(_MODULES[kind])
    except ImportError:
        raise _Unusable(f"{_MODULES[kind]} is not installed ({INSTALL_HINT})") from None
    return _KINDS[kind](run, run_id, workload, params, saved)


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


__all__ = ["RECORD", "Trackers", "open_trackers"]
