"""The run record: a run's status.json and events.jsonl, and the rule that labels a stop. The one home of these
rules, used by the control side (dtrain.control.userjob: this machine and SSH) and by the node side
(dtrain.common.slurmstep: a Slurm job's batch step). It imports only the standard library and dtrain.common.errors
at import time (the batch step runs with the standard library alone); a store's libraries load when it is used.

status.json  {"state", "exit_code", "error", "starts", "updated", "host", "pid", "peers", "job_id", "peak_memory", ...}
    state: running (written at each start), then completed | preempted | interrupted | failed at the end, or
    requeued (a Slurm job that starts again by itself: a preemption, a time-limit continuation, a hang restart).
    Every write replaces the file whole (Store.write_bytes is an atomic replace), keeping the fields it does not set.
    peak_memory: each rank's peak memory, {"<rank>": {"node", "rss_peak", "gpu_peak"?}} in bytes (record_peaks,
    from dtrain.common.resources.Recorder once the job has ended), kept across starts: the largest any reached.
events.jsonl  one row per event: {"time", "step", "event", "message", ...}, appended.

Stops. Each stop of a run carries exactly one label, the true one: the `event` of one events.jsonl row.

    preempted     dtrain or the cloud asked the job to stop (SIGTERM: a cancel, a Spot notice, a node's
                  shutdown) and it stopped as asked: safe to resume (exit 3). Written by the launcher at the end
                  (record_end), since only the launcher knows why the job was stopped; a built-in under a
                  launcher therefore writes no row of its own for it (dtrain.common.workload), only without one.
    time-limit    a Slurm job stopped before its time limit (slurmstep writes it, with the continuation).
    hang          a rank made no progress for the hang timeout (the launcher's hang watch writes it).
    failed        the job failed (the program's own row, with its error).
    interrupted   the user asked it to stop (Ctrl-C).

Whether a stop was asked for is one rule (job_outcome, from dtrain.common.errors.stop_outcome): a job ends
PREEMPTED only when it was asked to stop and every node stopped as asked; exit 3 that nobody asked for is a failure.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import ExitCode, stop_outcome, stopped_as_asked

if TYPE_CHECKING:
    from dtrain.common.storage import Store

STATUS = "status.json"
EVENTS = "events.jsonl"

RUNNING, COMPLETED, PREEMPTED, INTERRUPTED, FAILED, REQUEUED = (
    "running", "completed", "preempted", "interrupted", "failed", "requeued",
)  # fmt: skip
# The labels of a stop: the `event` of its one events.jsonl row.
TIME_LIMIT, HANG = "time-limit", "hang"
STOP_LABELS = frozenset({PREEMPTED, TIME_LIMIT, HANG, FAILED, INTERRUPTED})
# A start's status.json drops what the previous end said.
END_FIELDS = ("exit_code", "error", "pid")
# A node's processes that died of SIGTERM (128 + 15 from a shell or torchrun, -15 from Popen): someone outside the
# job (the cloud's notice, the node's shutdown) asked that node to stop.
SIGTERM_DEATHS = frozenset({128 + int(signal.SIGTERM), -int(signal.SIGTERM)})
PREEMPTED_MESSAGE = "preempted (SIGTERM): checkpoint saved"


def state_of(code: int) -> str:
    """status.json's end state for a job's exit code."""
    return {0: COMPLETED, int(ExitCode.PREEMPTED): PREEMPTED, int(ExitCode.INTERRUPTED): INTERRUPTED}.get(
        int(code), FAILED
    )


def job_outcome(code: int, codes: Iterable[int], *, asked: bool) -> int:
    """The job's exit code from `code` (its nodes' codes as its launcher combined them) and each node's own:
    `asked` is whether the launcher asked the job to stop (a cancel, a preemption it was told of, Slurm's
    signal); a node whose processes died of SIGTERM was asked too (a Spot notice, a node's shutdown), and a stop
    asked of one node is a stop asked of the job. Asked, with every node stopped as asked: PREEMPTED, whatever
    the nodes made of it (one exits 143, another 3 after its ranks checkpointed). Otherwise
    dtrain.common.errors.stop_outcome with the launcher's own `asked` (a node killed outright beside one that got
    SIGTERM is a failure; exit 3 that nobody asked for is a failure)."""
    codes = [int(c) for c in codes]
    signalled = asked or any(c in SIGTERM_DEATHS for c in codes)
    if signalled and codes and all(stopped_as_asked(c) for c in codes):
        return int(ExitCode.PREEMPTED)
    return stop_outcome(int(code), asked)


def event_row(kind: str, message: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
    """One events.jsonl row."""
    return {"time": round(time.time(), 3), "step": step, "event": kind, "message": message, **fields}


def append_events(run: Store, rows: Iterable[Mapping[str, Any]]) -> None:
    """Rows appended to the run's events.jsonl. Best effort, each row on its own: an event never fails a run."""
    for row in rows:
        with contextlib.suppress(Exception):
            run.append_bytes(EVENTS, (json.dumps(dict(row), default=str) + "\n").encode())


def read_status(run: Store) -> dict[str, Any] | None:
    from dtrain.common.rundir import read_json

    return read_json(run, STATUS)


def write_status(run: Store, body: Mapping[str, Any]) -> None:
    """status.json replaced whole (atomically, by the store)."""
    from dtrain.common.rundir import write_json

    write_json(run, STATUS, dict(body))


def update_status(run: Store, fields: Mapping[str, Any], *, drop: Iterable[str] = ()) -> dict[str, Any]:
    """status.json with `fields` set and `drop` removed, the rest kept, `updated` now. Returns what it wrote."""
    dropped = set(drop)
    prev = read_status(run) or {}
    body = {**{k: v for k, v in prev.items() if k not in dropped}, **fields, "updated": time.time()}
    write_status(run, body)
    return body


PEAK_MEMORY = "peak_memory"


def record_peaks(run: Store, peaks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """status.json's `peak_memory` with `peaks` merged in (each rank's larger value, an earlier start's kept)."""
    from dtrain.common.resources import merge_peaks

    prev = read_status(run) or {}
    merged = {str(k): dict(v) for k, v in (prev.get(PEAK_MEMORY) or {}).items() if isinstance(v, Mapping)}
    merge_peaks(merged, peaks)
    body = {**prev, PEAK_MEMORY: merged, "updated": time.time()}
    write_status(run, body)
    return body


def record_start(run: Store, *, starts: int, **fields: Any) -> dict[str, Any] | None:
    """status.json at a start: running, `starts` so far (this one included), and `fields` (host, pid, peers,
    job_id); the previous end's exit code, error and pid dropped. Returns the status.json it replaced."""
    before = read_status(run)
    update_status(run, {"state": RUNNING, "starts": starts, **fields}, drop=END_FIELDS)
    return before


def record_end(run: Store, code: int, *, error: str = "", requeued: bool = False) -> int:
    """status.json at the end of a start, from the job's exit code; returns that code. A program that recorded
    its own completion (a built-in) and then got a stop (its teardown) completed: exit 0. `requeued`: the job
    starts again by itself (Slurm), so the state is requeued and the exit code is left as it was. A stop that
    ended PREEMPTED gets its one label here (the events.jsonl row `preempted`, at the run's last complete
    checkpoint): the launcher is the one that knows the job was asked to stop."""
    prev = read_status(run) or {}
    if int(code) == ExitCode.PREEMPTED and prev.get("state") == COMPLETED:
        code, requeued = 0, False
    body = {**prev, "state": REQUEUED if requeued else state_of(code), "updated": time.time()}
    body.pop("pid", None)
    if not requeued:
        body["exit_code"] = int(code)
    if error:
        body["error"] = error
    write_status(run, body)
    if code == ExitCode.PREEMPTED:
        append_events(run, [event_row(PREEMPTED, PREEMPTED_MESSAGE, last_step(run), exit_code=int(code))])
    return int(code)


def last_step(run: Store) -> int | None:
    """The step of the run's last complete checkpoint in dtrain's layout (a built-in's), None without one."""
    try:
        from dtrain.common.rundir import checkpoints, find_latest

        found = find_latest(checkpoints(run))
    except Exception:  # noqa: BLE001 - the label matters, the step is a detail
        return None
    return found.step if found is not None else None
