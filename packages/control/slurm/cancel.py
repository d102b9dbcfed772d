"""Cancel a queued or running job (`cancel`): Slurm sends SIGTERM to every rank, they checkpoint and stop, and
the result names the run's last checkpoint (or settles a cancelled evaluation's record).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shlex
import time

from dtrain.common.errors import UserError
from dtrain.common.storage import is_remote
from dtrain.control.cluster import Cluster
from dtrain.control.events import Events, Handle
from dtrain.control.slurm.commands import JobState
from dtrain.control.slurm.session import POLL_S, JobRecord, Session

CANCEL_WAIT_S = 180.0  # cancel waits for the ranks to checkpoint and stop (KillWait is 60 s on dtrain's clusters)


@dataclasses.dataclass(frozen=True)
class CancelResult:
    job_id: str
    run_id: str
    url: str
    was: str  # Slurm's state when cancelled (PENDING, RUNNING)
    state: JobState | None  # after: CANCELLED once the ranks have checkpointed and stopped
    checkpoint: str  # the run's last complete checkpoint (step-XXXXXXXX), "" if none (or an evaluation's job)
    eval_id: str = ""  # the job evaluated the run (dtrain eval --queue): this evaluation was stopped


def cancel(
    cluster: Cluster, job_id: str, *, events: Events, handle: Handle, accept_new_host_keys: bool = False
) -> CancelResult:
    """Cancel a queued or running job: Slurm sends SIGTERM to every rank, they checkpoint and stop, the
    job ends CANCELLED. Waits (at most CANCEL_WAIT_S) until no process of the job is left."""
    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        rec = s.record(job_id)
        before = s.state(rec)
        if before is None or not before.active:
            how = f"{before.state}{f' at {before.ended}' if before.ended else ''}" if before else "Slurm has no record"
            raise UserError(f"job {job_id} has already ended ({how}): nothing to cancel; its run is {rec.url}")
        s.slurm.cancel(job_id)
        events.info(f"cancelling job {job_id} ({before.state}): its ranks checkpoint and stop")
        state = _wait_settled(s, rec, CANCEL_WAIT_S, handle)
        if rec.eval_id and state is not None and state.settled:
            _settle_eval(s, rec)
        checkpoint = "" if rec.eval_id else _checkpoint(s, rec)
        return CancelResult(job_id, rec.run_id, rec.url, before.state, state, checkpoint, rec.eval_id)


def _wait_settled(s: Session, rec: JobRecord, timeout: float, handle: Handle) -> JobState | None:
    deadline = time.monotonic() + timeout
    while True:
        state = s.state(rec)
        if state is None or state.settled or time.monotonic() > deadline or handle.stopped:
            return state
        time.sleep(POLL_S)


# On the login node, with the job's code (its directory there): the record of an evaluation on a path there.
SETTLE_EVAL = (
    "import sys; from dtrain.common.storage import open_store; from dtrain.evaluate import records; "
    "records.mark_cancelled(open_store(sys.argv[1]), sys.argv[2])"
)


def _settle_eval(s: Session, rec: JobRecord) -> None:
    """A cancelled evaluation's record: one cancelled while queued never started and still says pending
    (one cancelled while running says failed, interrupted, itself). Best effort: the job is cancelled."""
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.storage import open_store
            from dtrain.evaluate import records

            records.mark_cancelled(open_store(rec.url), rec.eval_id)
            return
        py, d = shlex.quote(s.login.python), shlex.quote(rec.dir)
        args = " ".join(shlex.quote(a) for a in (SETTLE_EVAL, rec.url, rec.eval_id))
        s.slurm.run(f'cd {d} && PYTHONPATH="$PWD/code" {py} -c {args}')


# On the login node, with the job's code (its directory there): a built-in run's last complete checkpoint.
LATEST_CHECKPOINT = (
    "import sys; from dtrain.common.rundir import last_checkpoint_name; print(last_checkpoint_name(sys.argv[1]))"
)


def _checkpoint(s: Session, rec: JobRecord) -> str:
    """The name of a built-in run's last complete checkpoint (step-XXXXXXXX), read where the run lives; for a
    user's program, the newest copy of its checkpoint directory (ckpt/node-<n>/<seq>.json, dtrain.common.mirror)."""
    if rec.kind == "program":
        return _checkpoint_copy(s, rec)
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.rundir import last_checkpoint_name

            return last_checkpoint_name(rec.url)
        py, d = shlex.quote(s.login.python), shlex.quote(rec.dir)
        args = " ".join(shlex.quote(a) for a in (LATEST_CHECKPOINT, rec.url))
        return s.slurm.run(f'cd {d} && PYTHONPATH="$PWD/code" {py} -c {args}').strip()
    return ""


def _checkpoint_copy(s: Session, rec: JobRecord) -> str:
    """A program run's newest checkpoint-directory copy (the copy a --resume or requeue restores), "" if none."""
    from dtrain.common.rundir import CKPT_PREFIX

    names: list[str] = []
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.storage import open_store

            names = open_store(rec.url).child(CKPT_PREFIX).list("node-")
        else:
            d = shlex.quote(f"{rec.url}/{CKPT_PREFIX}")
            out = s.slurm.run(f"cd {d} 2>/dev/null && ls -1 node-*/*.json 2>/dev/null || true")
            names = out.split()
    manifests = [n for n in names if re.fullmatch(r"node-\d{5}/\d{8}\.json", n)]
    if not manifests:
        return ""
    newest = max(manifests, key=lambda n: n.rsplit("/", 1)[1])
    return f"{CKPT_PREFIX}/{newest}"
