"""The cluster service's decisions, without I/O: given what it saw this poll (the Compute API's view of
the VMs, Slurm's queue and nodes, the login sessions) and what it remembers (State), what to do next.

Rules (docs/service.md says why):
  - Recovery acts only on a confirmed preemption: a VM that is TERMINATED/STOPPED *and* has a
    `compute.instances.preempted` operation after its last start (gcp.vmstates.node_states' `preempted`). A
    failed or odd status call changes nothing and starts nothing (skypilot#10155).
  - A start is tried again with exponential backoff (START_BACKOFF_S doubling, capped at
    START_BACKOFF_CAP_S), for ever: a zone without capacity says "waiting for capacity in <zone> since
    HH:MM" in the state file, which `dtrain jobs`/`status` show.
  - Once started, the node is returned to Slurm (scontrol update state=resume) when its slurmd answers.
  - Autostop: idle means no job that can still run (running, or pending on a reason that can clear) and
    no login session, with no node in recovery and every check answered, for `autostop_s`. Then the
    workers stop, and the master last (it is the machine this runs on).
  - A node that cannot come back does not keep the cluster up for ever: once a node has been out of
    service for `capacity_wait_s` (the `capacity_wait` key, default 2 h), autostop fires anyway, unless a
    job is running or someone is logged in. Out of service means from its first preemption until it has
    been back in Slurm for RECOVERED_S, whatever kept it out: a stockout, a start refused for another
    reason (QUOTA_EXCEEDED when another VM took the freed preemptible quota: "start-failed"), or a node
    preempted again soon after each start (a successful start does not reset the wait). The jobs pending
    for the missing node stay in Slurm's queue (on the master's disk with "stop"): the next `dtrain
    up`/`submit` starts the cluster and they run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

START_BACKOFF_S = 5.0
START_BACKOFF_CAP_S = 300.0
CAPACITY_WAIT_S = 2 * 3600.0  # the default bound on waiting for a node to come back before autostop fires
# A node back in Slurm for this long has come back: its next preemption starts a new wait. Shorter stays
# (preempted again soon after each start) add up to one wait, so they cannot hold the cluster up for ever.
RECOVERED_S = 30 * 60.0

# A pending job waiting on one of these reasons will not run without someone acting (a hold, a request the
# cluster can never satisfy, a dependency that failed): it does not keep the cluster up (skypilot#9926).
# Every other pending reason (Resources, Priority, BeginTime, NodeDown, ReqNodeNotAvail, ...) does.
NEVER_RUNS = frozenset(
    {
        "JobHeldUser", "JobHeldAdmin", "DependencyNeverSatisfied", "BadConstraints", "PartitionNodeLimit",
        "PartitionTimeLimit", "PartitionConfig", "InvalidAccount", "InvalidQOS", "AccountNotAllowed",
        "QOSNotAllowed", "InactiveLimit", "FrontEndDown",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Vm:
    """One VM as the Compute API showed it this poll."""

    name: str
    status: str  # RUNNING, TERMINATED, STOPPED, STAGING, ... MISSING
    preempted: bool  # a confirmed preemption (see the module docstring)
    preempted_at: str | None = None


@dataclasses.dataclass(frozen=True)
class QueuedJob:
    """One job in Slurm's queue (squeue)."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str
    nodes: tuple[str, ...]  # where it runs (empty while pending)
    stalled: bool = False  # running, but its run's metrics have not advanced for stall_after

    @property
    def keeps_busy(self) -> bool:
        """A stalled job holds its nodes but does no work (skypilot#715, #10628): not activity."""
        if self.stalled:
            return False
        return self.state != "PENDING" or self.reason.split(",")[0].strip() not in NEVER_RUNS


@dataclasses.dataclass(frozen=True)
class Seen:
    """One poll's observations. None: that check failed this time (never read as "nothing there")."""

    vms: dict[str, Vm] | None
    vm_error: str = ""
    jobs: tuple[QueuedJob, ...] | None = None
    slurm_up: frozenset[str] | None = None  # nodes whose slurmd answers (sinfo: not down, not "*")
    sessions: int | None = None  # interactive login sessions on the master


@dataclasses.dataclass
class NodeTrack:
    """What the service remembers about one node."""

    phase: str = "ok"  # ok | starting | waiting-capacity | start-failed | returning
    last_action: str = ""
    last_action_at: float = 0.0
    restarts: int = 0
    attempts: int = 0  # failed starts since the preemption
    next_try: float = 0.0
    capacity_since: float | None = None  # waiting for Spot capacity since (this stockout)
    down_since: float | None = None  # out of service since: its first preemption of this bout (RECOVERED_S)
    back_at: float = 0.0  # when it was last returned to Slurm
    last_error: str = ""
    preempted_at: str = ""
    jobs: list[str] = dataclasses.field(default_factory=list)  # the jobs it ran when it was preempted


@dataclasses.dataclass
class State:
    """The service's memory, and the state file the CLI reads (as_dict)."""

    cluster: str
    zone: str
    master: str
    workers: list[str]
    autostop_s: float | None  # None: off
    autostop_action: str = "stop"
    capacity_wait_s: float | None = CAPACITY_WAIT_S  # None: wait for capacity for ever
    nodes: dict[str, NodeTrack] = dataclasses.field(default_factory=dict)
    job_nodes: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # job -> nodes it last ran on
    idle_since: float | None = None
    autostop_at: float | None = None
    stopping: bool = False
    stopped: bool = False
    stop_reason: str = ""  # why autostop fired ("idle since 14:02", "waiting for Spot capacity since 14:02")
    status_error: str = ""  # the last failed status call, while it keeps failing
    status_error_at: float | None = None
    updated: float = 0.0
    note: str = ""

    def track(self, name: str) -> NodeTrack:
        return self.nodes.setdefault(name, NodeTrack())

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> State:
        d = dict(d)
        nodes = {k: NodeTrack(**v) for k, v in d.pop("nodes", {}).items()}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(nodes=nodes, **{k: v for k, v in d.items() if k in known})


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # start | resume | stop | delete
    node: str


@dataclasses.dataclass(frozen=True)
class Note:
    """Something to record in the affected runs' events.jsonl (and the service's log)."""

    kind: str  # preempted | restarted | resumed | waiting-capacity | autostop
    node: str
    message: str
    jobs: tuple[str, ...] = ()


def backoff(attempts: int) -> float:
    return min(START_BACKOFF_CAP_S, START_BACKOFF_S * 2 ** max(0, attempts - 1))


def hhmm(epoch: float) -> str:
    return time.strftime("%H:%M", time.localtime(epoch))


def decide(state: State, seen: Seen, now: float) -> tuple[list[Action], list[Note]]:
    """This poll's actions (in order) and notes; updates `state` with what it saw (not with the actions'
    outcomes: `started`, `start_failed`, `resumed` do that)."""
    actions: list[Action] = []
    notes: list[Note] = []
    state.updated = now
    if seen.jobs is not None:
        for j in seen.jobs:
            if j.nodes:
                state.job_nodes[j.job_id] = list(j.nodes)
        active = {j.job_id for j in seen.jobs}
        state.job_nodes = {k: v for k, v in state.job_nodes.items() if k in active}

    if seen.vms is None:  # a failed status call: do nothing, say so
        state.status_error = seen.vm_error or "the status call failed"
        state.status_error_at = state.status_error_at or now
        state.idle_since = state.autostop_at = None
        return actions, notes
    state.status_error, state.status_error_at = "", None

    for name in [state.master, *state.workers]:
        vm = seen.vms.get(name)
        t = state.track(name)
        if vm is None:
            continue
        if t.phase == "ok" and t.down_since is not None and now - t.back_at >= RECOVERED_S:
            t.down_since = None  # it came back
        if vm.preempted and vm.status in ("TERMINATED", "STOPPED"):
            if t.phase in ("ok", "returning"):
                jobs = _jobs_on(state, name, seen)
                t.down_since = t.down_since or now  # kept when it was back only briefly
                t.phase, t.attempts, t.next_try = "starting", 0, now
                t.capacity_since, t.last_error, t.preempted_at, t.jobs = None, "", vm.preempted_at or "", jobs
                notes.append(Note("preempted", name, f"node {name} was preempted (Spot)", tuple(jobs)))
            if now >= t.next_try and not state.stopping:
                actions.append(Action("start", name))
        elif t.phase == "returning" and vm.status == "RUNNING":
            if seen.slurm_up is not None and name in seen.slurm_up:
                actions.append(Action("resume", name))
        elif t.phase in ("starting", "waiting-capacity", "start-failed") and vm.status == "RUNNING":
            t.phase = "returning"  # started by someone else (dtrain up/submit): return it to Slurm
        if t.phase != "ok" and t.down_since is None:
            t.down_since = t.capacity_since or now  # a state file from before down_since

    _autostop(state, seen, now, actions)
    return actions, notes


def _jobs_on(state: State, node: str, seen: Seen) -> list[str]:
    """The jobs the preempted node was running: from this poll or the last ones (Slurm may already have
    requeued them); when the service saw none (it started after the preemption), every active job."""
    jobs = [j for j, nodes in state.job_nodes.items() if node in nodes]
    if not jobs and seen.jobs:
        jobs = [j.job_id for j in seen.jobs]
    return sorted(jobs, key=int)


def waiting_for(state: State) -> tuple[float, str] | None:
    """(since when, what for) while a node is out of service: the longest wait (a node's down_since), and
    "Spot capacity" when a node waits for it, else the nodes that have not come back. None: every node is
    in service."""
    out = {n: t for n, t in state.nodes.items() if t.phase != "ok" and t.down_since is not None}
    if not out:
        return None
    since = min(t.down_since for t in out.values())
    if any(t.phase == "waiting-capacity" for t in out.values()):
        return since, "Spot capacity"
    return since, f"{', '.join(sorted(out))} to come back"


def _autostop(state: State, seen: Seen, now: float, actions: list[Action]) -> None:
    if state.autostop_s is None or state.stopping:
        return
    unknown = seen.jobs is None or seen.sessions is None
    recovering = any(t.phase != "ok" for t in state.nodes.values())
    working = bool(seen.sessions) or any(j.keeps_busy and j.state != "PENDING" for j in seen.jobs or ())
    waiting = waiting_for(state)
    if waiting is not None and state.capacity_wait_s is not None and not unknown and not working:
        # A node that does not come back (a stockout, a refused start, preempted again after each start):
        # the jobs pending for it cannot run, and the on-demand master bills meanwhile. Bounded: after
        # capacity_wait_s out of service, stop anyway.
        since, what = waiting
        state.idle_since = None
        state.autostop_at = since + state.capacity_wait_s
        if now >= state.autostop_at:
            actions[:] = [a for a in actions if a.kind != "start"]
            _stop_all(state, seen, actions, f"waiting for {what} since {hhmm(since)}")
        return
    busy = unknown or recovering or working or any(j.keeps_busy for j in seen.jobs or ())
    if busy:
        state.idle_since = state.autostop_at = None
        return
    if state.idle_since is None:
        state.idle_since = now
    state.autostop_at = state.idle_since + state.autostop_s
    if now >= state.autostop_at:
        _stop_all(state, seen, actions, f"idle since {hhmm(state.idle_since)}")


def _stop_all(state: State, seen: Seen, actions: list[Action], reason: str) -> None:
    kind = "delete" if state.autostop_action == "delete" else "stop"
    vms = seen.vms or {}
    # Workers already stopped (or gone) need no call; a stopped one is still deleted by "delete".
    skip = ("MISSING",) if kind == "delete" else ("MISSING", "TERMINATED", "STOPPED")
    running = [w for w in state.workers if w in vms and vms[w].status not in skip]
    actions.extend(Action(kind, w) for w in running)
    actions.append(Action(kind, state.master))  # last: the service runs on it
    state.stopping, state.stop_reason = True, reason


# -- outcomes of the actions ----------------------------------------------------------------------------


def started(state: State, name: str, now: float) -> Note:
    t = state.track(name)
    waited = f" after waiting for capacity since {hhmm(t.capacity_since)}" if t.capacity_since else ""
    t.phase, t.restarts, t.last_action, t.last_action_at = "returning", t.restarts + 1, "started", now
    t.capacity_since, t.last_error, t.attempts = None, "", 0
    return Note("restarted", name, f"node {name} started again{waited} (restart {t.restarts})", tuple(t.jobs))


def start_failed(state: State, name: str, now: float, message: str, *, no_capacity: bool) -> Note | None:
    """A refused start: try again after the backoff. A note only on the first refusal of a kind."""
    t = state.track(name)
    t.attempts += 1
    t.next_try = now + backoff(t.attempts)
    t.last_error, t.last_action, t.last_action_at = message, "start refused", now
    first = t.phase not in ("waiting-capacity",) if no_capacity else t.phase != "start-failed"
    if no_capacity:
        t.capacity_since = t.capacity_since or now
        t.phase = "waiting-capacity"
    else:
        t.phase = "start-failed"
    if not first:
        return None
    what = f"waiting for capacity in {state.zone}" if no_capacity else f"start failed ({message})"
    return Note("waiting-capacity" if no_capacity else "start-failed", name, f"node {name}: {what}", tuple(t.jobs))


def resumed(state: State, name: str, now: float) -> Note:
    t = state.track(name)
    t.phase, t.last_action, t.last_action_at, t.back_at = "ok", "returned to Slurm", now, now
    jobs, t.jobs = tuple(t.jobs), []
    return Note("resumed", name, f"node {name} is back in Slurm: its requeued jobs resume from their checkpoints", jobs)


def describe(state: State, now: float) -> list[str]:
    """The lines `dtrain jobs`/`status` show under "service:"."""
    lines = []
    if state.stopped or state.stopping:
        why = f" ({state.stop_reason})" if state.stop_reason else ""
        lines.append(f"autostop: {state.autostop_action} of every node {'done' if state.stopped else 'under way'}{why}")
    if state.status_error:
        since = hhmm(state.status_error_at) if state.status_error_at else "?"
        lines.append(f"status calls failing since {since} ({state.status_error}): nothing is done meanwhile")
    for name in [state.master, *state.workers]:
        t = state.nodes.get(name)
        if t is None:
            continue
        if t.phase == "waiting-capacity" and t.capacity_since:
            lines.append(
                f"{name}: preempted; waiting for capacity in {state.zone} since {hhmm(t.capacity_since)} "
                f"({t.attempts} tries, next in {max(0, t.next_try - now):.0f} s)"
            )
        elif t.phase == "start-failed":
            lines.append(f"{name}: preempted; start failed ({t.last_error}); trying again in "
                         f"{max(0, t.next_try - now):.0f} s")  # fmt: skip
        elif t.phase == "starting":
            lines.append(f"{name}: preempted; starting it")
        elif t.phase == "returning":
            lines.append(f"{name}: started; waiting for its slurmd to return it to Slurm")
        if t.restarts:
            lines.append(f"{name}: {t.restarts} restart(s) after preemption; last: {t.last_action} at "
                         f"{hhmm(t.last_action_at)}")  # fmt: skip
    waiting = waiting_for(state)
    if state.autostop_s is None:
        lines.append("autostop: off")
    elif waiting is not None and state.capacity_wait_s is not None and not state.stopping:
        since, what = waiting
        at = since + state.capacity_wait_s
        back = "capacity returns" if what == "Spot capacity" else "they return"
        lines.append(f"autostop: waiting for {what} since {hhmm(since)}, autostop in "
                     f"{_duration(max(0.0, at - now), rounded=True)} (at {hhmm(at)}) unless a job runs or {back}; "
                     f"{state.autostop_action} then")  # fmt: skip
    elif waiting is not None and state.capacity_wait_s is None and not state.stopping:
        since, what = waiting
        lines.append(f"autostop: waiting for {what} since {hhmm(since)}; no bound (capacity_wait = off)")
    elif state.autostop_at and not state.stopping:
        since, at = hhmm(state.idle_since or now), hhmm(state.autostop_at)
        lines.append(f"autostop: idle since {since}; {state.autostop_action} at {at}")
    elif not state.stopping:
        lines.append(f"autostop: after {_duration(state.autostop_s)} idle ({state.autostop_action}); not idle now")
    return lines


def _duration(seconds: float, *, rounded: bool = False) -> str:
    s = int(seconds)
    if rounded and s >= 60:  # a countdown: whole minutes are precise enough
        s = (s + 59) // 60 * 60
    return f"{s // 60} min" if s >= 60 and s % 60 == 0 else f"{s} s"
