"""Progress of a job's ranks: the heartbeat each rank writes, and the rules that call a rank hung or a
straggler. Standard library only: the node agent imports it before any job starts.

The heartbeat: `<DTRAIN_PROGRESS_DIR>/rank-<RANK>` holds "<step> <unix time>", rewritten (atomically) at
most once every BEAT_EVERY_S by `beat(step)`: the built-ins call it after every step (Context.stop_requested),
dtrain.sdk.log(step=...) does the same on every rank (its own copy of these few lines: the SDK imports
nothing it does not need).

The node agent's Watcher reads those files and, for ranks that never wrote one (user code without the SDK),
the CPU time of each rank's process tree (utime + stime in /proc/<pid>/stat). What each signal cannot see:
- a heartbeat only moves when a step ends: a long evaluation or checkpoint upload between two steps looks
  like a hang if it outlasts the timeout (the default is K x the median step, at least FLOOR_S);
- CPU time: a rank spinning in a busy-wait (a collective that polls, a CUDA synchronize that spins) looks
  alive; a rank blocked on slow I/O or on a peer looks hung once the timeout has passed. For that reason a
  rank judged by its CPU gets NO_STEP_TIMEOUT_S unless the job sets --hang-timeout.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROGRESS_DIR = "DTRAIN_PROGRESS_DIR"  # = jobenv.PROGRESS_DIR (jobenv documents it; this module stays stand-alone)
STACKS_DIR = "DTRAIN_INTERNAL_STACKS_DIR"  # where sitecustomize's SIGUSR1 handler writes <pid>.txt
BEAT_EVERY_S = 1.0  # a heartbeat file is rewritten at most this often
FLOOR_S = 30.0  # the automatic hang timeout is never shorter
K = 10.0  # ... and otherwise K x the rank's median step interval
MIN_STEPS = 3  # steps seen between heartbeats before the automatic timeout applies
NO_STEP_TIMEOUT_S = 900.0  # a rank with no step yet (starting, or user code without the SDK): judged by CPU
# Start-up (a rank's first MIN_STEPS steps: rendezvous, NCCL init, data loading, the first collectives) has a
# bound of its own: a rank that makes no progress for this long before then is hung at start-up. Set by the
# launch setting startup_timeout (0: none of its own, the hang timeout's rule: NO_STEP_TIMEOUT_S when automatic).
STARTUP_TIMEOUT_S = 300.0
STRAGGLER_RATIO = 1.5  # a rank whose median step is this much slower than the others' median
HUNG_EXIT = 4  # = errors.ExitCode.HUNG: the node agent stopped a hung job


# --- writing ---------------------------------------------------------------------------------------------


class Heartbeat:
    """Writes `<directory>/rank-<rank>`, at most once every `every_s` (the step of the last call wins)."""

    def __init__(self, directory: str, rank: str, every_s: float = BEAT_EVERY_S) -> None:
        self.path = os.path.join(directory, f"rank-{rank}")
        self.every_s = every_s
        self._last = -float("inf")

    def __call__(self, step: int) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        tmp = f"{self.path}.tmp"
        with contextlib.suppress(OSError):  # a full disk must not stop training
            with open(tmp, "w") as f:
                f.write(f"{int(step)} {time.time():.3f}\n")
            os.replace(tmp, self.path)


_heartbeat: Heartbeat | None = None


def beat(step: int) -> None:
    """This rank made step `step`; does nothing outside a dtrain job (no DTRAIN_PROGRESS_DIR)."""
    global _heartbeat
    if _heartbeat is None:
        directory = os.environ.get(PROGRESS_DIR)
        if not directory:
            return
        _heartbeat = Heartbeat(directory, os.environ.get("RANK") or "0")
    _heartbeat(step)


def read_beat(path: str | Path) -> tuple[int, float] | None:
    """(step, unix time) from a heartbeat file, or None (absent, or being replaced)."""
    try:
        step, t = Path(path).read_text().split()
        return int(step), float(t)
    except (OSError, ValueError):
        return None


# --- rules -----------------------------------------------------------------------------------------------


def starting(intervals: list[float], steps: int | None = None) -> bool:
    """Whether a rank is still starting: its heartbeats span fewer than MIN_STEPS steps (`steps`; by default
    one step an interval), so its step time is not known yet."""
    return not intervals or (len(intervals) if steps is None else steps) < MIN_STEPS


def hang_timeout(
    intervals: list[float], explicit: float | None, steps: int | None = None, startup: float | None = None
) -> float:
    """Seconds without progress after which a rank is hung. While it is starting (`starting`): the shorter of
    `startup` (the start-up bound, startup_timeout) and `explicit` (--hang-timeout), those that are set, else
    NO_STEP_TIMEOUT_S. Then `explicit` when set, else max(FLOOR_S, K x the median step interval)."""
    if starting(intervals, steps):
        bounds = [float(b) for b in (explicit, startup) if b]
        return min(bounds) if bounds else NO_STEP_TIMEOUT_S
    if explicit:
        return float(explicit)
    return max(FLOOR_S, K * statistics.median(intervals))


def stragglers(medians: Mapping[str, float], ratio: float = STRAGGLER_RATIO) -> dict[str, float]:
    """Ranks whose median step interval is more than `ratio` x the median of the other ranks':
    rank -> how many times slower. Needs two ranks or more."""
    out: dict[str, float] = {}
    for rank, own in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        if not others:
            continue
        typical = statistics.median(others)
        if typical > 0 and own > ratio * typical:
            out[rank] = round(own / typical, 2)
    return out


def straggler_note(found: Mapping[str, float]) -> str:
    """The line a launcher prints (and records as a "straggler" event) when the set of stragglers changes:
    `found` is "<host> rank <r>" -> how many times slower, {} when there is none any more."""
    if not found:
        return "dtrain: no straggler any more"
    return "dtrain: straggler: " + ", ".join(
        f"{k} ({x:.1f}x the others' median step)" for k, x in sorted(found.items())
    )


class StragglerSet:
    """A job's stragglers across its nodes, from each node's per-rank median step intervals (an agent's "alive"
    line, or this machine's watcher): `update` gives the line to print and record (straggler_note) when the set of
    stragglers changed, else None. The SSH launcher, Slurm's batch step and the local watch each keep one."""

    def __init__(self) -> None:
        self.medians: dict[str, dict[str, float]] = {}  # node -> rank -> median step interval (s)
        self.now: dict[str, float] = {}  # "<node> rank <r>" -> times slower, as last reported

    def update(self, node: str, medians: Mapping[Any, Any]) -> str | None:
        with contextlib.suppress(TypeError, ValueError):
            self.medians[node] = {str(r): float(m) for r, m in medians.items()}
        now = stragglers({f"{n} rank {r}": m for n, ms in self.medians.items() for r, m in ms.items()})
        if set(now) == set(self.now):
            return None
        self.now = now
        return straggler_note(now)


# --- what a hang is called -------------------------------------------------------------------------------
# One wording on every backend: the line a launcher prints (and the run's events.jsonl keeps), and the error
# a hung run's status.json ends with. `facts` are a hang event's: node, rank, step, age_s, stacks (where the
# stuck rank's stacks are); or node and silent_s for an agent that stopped answering.


def _since(step: Any) -> str:
    return "before its first step" if step is None else f"since step {step}"


STARTUP = "at start-up"  # what the line and the error add for a hang while starting (the event's "phase": "startup")


def _phase(startup: bool) -> str:
    return f", {STARTUP}" if startup else ""


def hang_line(node: str, rank: Any, age_s: Any, step: Any, where: str, *, startup: bool = False) -> str:
    """The one line a hang gets: "dtrain: hang on h1 rank 2: no progress for 31 s since step 25; stacks in ...";
    a hang while starting (the start-up bound) says so: "... before its first step, at start-up; stacks in ..."."""
    age = f"{float(age_s or 0):.0f} s"
    return (
        f"dtrain: hang on {node} rank {rank}: no progress for {age} {_since(step)}{_phase(startup)}; stacks in {where}"
    )


def silent_line(node: str, limit_s: float) -> str:
    return f"dtrain: hang on {node}: its agent has printed nothing for {limit_s:.0f} s; stopping the job"


def hang_error(facts: Mapping[str, Any]) -> str:
    """status.json's error for a job stopped for the hang these facts describe."""
    if facts.get("silent_s") is not None:
        return f"hung: the agent on {facts.get('node')} printed nothing for {float(facts['silent_s']):.0f} s"
    age, where = f"{float(facts.get('age_s') or 0):.0f} s", facts.get("stacks") or "hangs/"
    return (
        f"hung: no progress for {age} on {facts.get('node')} rank {facts.get('rank')} {_since(facts.get('step'))}"
        f"{_phase(facts.get('phase') == 'startup')}; stacks in {where}"
    )


def hang_report(run_url: str, node: str, ev: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    """An agent's hang event (dtrain.common.nodeagent.HangWatch.report) as a run records it: the line, the event's
    facts, and the stack files (path in the run -> text). `run_url` "" (no run to write to): the stacks are named
    where the agent left them."""
    files = {f"hangs/{node}-rank{r}.txt": str(text) for r, text in (ev.get("stacks") or {}).items()}
    rel = f"hangs/{node}-rank{ev.get('rank')}.txt"
    where = f"{run_url.rstrip('/')}/{rel}" if run_url and rel in files else f"the agent's hangs/ on {node}"
    facts = {"node": node, "rank": ev.get("rank"), "step": ev.get("step"), "age_s": ev.get("age_s"),
             "timeout_s": ev.get("timeout_s"), "state": ev.get("state"), "stacks": where}  # fmt: skip
    startup = ev.get("phase") == "startup"
    if startup:
        facts["phase"] = "startup"
    return hang_line(node, ev.get("rank"), ev.get("age_s"), ev.get("step"), where, startup=startup), facts, files


# --- watching a node's ranks -----------------------------------------------------------------------------


@dataclass
class Rank:
    """What the watcher knows of one rank on this node."""

    rank: str
    pid: int
    state: str = "?"  # /proc state of the rank's process: R, S, D, T (stopped), Z ...
    step: int | None = None  # last step from the heartbeat
    progress_at: float = 0.0  # unix time of the last progress (heartbeat, or CPU time that moved)
    cpu: int = -1  # clock ticks of the rank's process tree
    intervals: list[float] = field(default_factory=list)  # seconds per step, from heartbeat changes
    steps_seen: int = 0  # steps those intervals span
    last_beat: tuple[int, float] | None = None

    def median(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None


@dataclass(frozen=True)
class Hang:
    rank: Rank
    age_s: float
    timeout_s: float
    others: list[Rank]  # every rank of this node that is past its timeout too, the stuck one first
    startup: bool = False  # the stuck rank was still starting (its first MIN_STEPS steps): a start-up hang

    def facts(self) -> dict[str, Any]:
        """What a hang event says of the phase: {"phase": "startup"} for a start-up hang, else nothing."""
        return {"phase": "startup"} if self.startup else {}


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, utime + stime) of a process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[11]) + int(fields[12])


def env_value(pid: int, name: str) -> str | None:
    """A variable of a process's environment as it started (/proc/<pid>/environ), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    key = name.encode() + b"="
    for item in env:
        if item.startswith(key):
            return item[len(key) :].decode(errors="replace")
    return None


def _rank_of(pid: int) -> str | None:
    return env_value(pid, "RANK")


class Watcher:
    """The ranks of one job on this node, found in its process tree (the process that first carries RANK in
    its environment; its children, data loader workers, count towards its CPU time). `poll()` once a second;
    it returns a Hang when a rank made no progress for its timeout."""

    def __init__(
        self,
        directory: str,
        explicit_timeout: float | None = None,
        *,
        settle_s: float = 5.0,
        startup_s: float | None = STARTUP_TIMEOUT_S,
    ) -> None:
        self.dir = directory
        self.explicit = explicit_timeout or None
        self.startup = startup_s or None  # the start-up bound (None or 0: none of its own)
        self.settle_s = settle_s  # no stopped (T) rank: wait this much more, so the node with one acts first
        self.ranks: dict[str, Rank] = {}

    def poll(self, pids: list[int], now: float | None = None) -> Hang | None:
        now = time.time() if now is None else now
        stats = {p: s for p in pids if (s := _stat(p)) is not None}
        ranked: dict[int, str] = {}
        for p in stats:
            r = _rank_of(p)
            if r is not None:
                ranked[p] = r
        tops = {p: r for p, r in ranked.items() if stats[p][0] not in ranked}
        children: dict[int, list[int]] = {}
        for p, (ppid, _state, _cpu) in stats.items():
            children.setdefault(ppid, []).append(p)
        for pid, r in tops.items():
            rk = self.ranks.get(r)
            if rk is None or rk.pid != pid:  # a new rank, or a restarted one: start afresh
                rk = self.ranks[r] = Rank(r, pid, progress_at=now)
            cpu, todo = 0, [pid]
            while todo:
                q = todo.pop()
                cpu += stats[q][2]
                todo.extend(children.get(q, []))
            rk.state = stats[pid][1]
            self._update(rk, cpu, now)
        for r in [r for r, rk in self.ranks.items() if rk.pid not in tops]:
            del self.ranks[r]  # ended
        return self._judge(now)

    def _update(self, rk: Rank, cpu: int, now: float) -> None:
        got = read_beat(os.path.join(self.dir, f"rank-{rk.rank}"))
        if got is not None and got != rk.last_beat:
            if rk.last_beat is not None and got[0] > rk.last_beat[0] and got[1] > rk.last_beat[1]:
                rk.intervals.append((got[1] - rk.last_beat[1]) / (got[0] - rk.last_beat[0]))
                rk.steps_seen += got[0] - rk.last_beat[0]
                del rk.intervals[:-50]
            rk.last_beat, rk.step = got, got[0]
            rk.progress_at = max(rk.progress_at, got[1])
        elif rk.last_beat is None and cpu != rk.cpu:  # no heartbeat yet: CPU time is the progress
            rk.progress_at = now
        rk.cpu = cpu

    def timeout(self, rk: Rank) -> float:
        return hang_timeout(rk.intervals, self.explicit, rk.steps_seen, self.startup)

    def _judge(self, now: float) -> Hang | None:
        late = [rk for rk in self.ranks.values() if now - rk.progress_at > self.timeout(rk)]
        if not late:
            return None
        late.sort(key=lambda rk: (rk.state != "T", rk.progress_at))
        stuck = late[0]
        age = now - stuck.progress_at
        if stuck.state != "T" and age <= self.timeout(stuck) + self.settle_s:
            return None
        return Hang(stuck, age, self.timeout(stuck), late, starting(stuck.intervals, stuck.steps_seen))

    def medians(self) -> dict[str, float]:
        return {r: m for r, rk in self.ranks.items() if (m := rk.median()) is not None}
