"""How long operations talk to whoever called them, and how they are stopped.

An operation (launch, up, down, build, ...) never prints and never installs a signal handler. It
takes an `Events` to report what it is doing and a `Handle` through which its caller asks it to
stop, and it returns a result object (or raises UserError). The CLI turns events into rich output
and Ctrl-C into `handle.interrupt()`; a service stores the events and calls the same handle from
an HTTP request; a test collects the events and asserts on them.

    events = Events(print)                      # any callable taking an Event
    events.info("created the state bucket")
    events.emit("output", line, node="n1")      # a job's line from node n1

Event kinds and their data (the message is plain text, never markup). This is every kind dtrain emits
(tests/test_architecture.py holds the code to this list):

    info / warning      message
    check               message, ok (bool): one line of a checklist (preflight, readiness)
    stage               message: the operation moved to a new stage (waiting for nodes, ...)
    hang                message (one line: node, rank, last step, stack file), node, rank, step, age_s,
                        timeout_s, state, stacks; or node, silent_s for an agent that stopped answering
    straggler           message, stragglers ({"<node> rank <r>": times slower}; {}: none any more)
    output              message (the line), node: a job's output line
    progress            description, completed, total, status: rank 0's training progress
    launch              message: a job or an evaluation is starting (with its ids)
    plan                message, plan: what `dtrain up` is about to create
    terraform_start / terraform_end     verb: a Terraform command starts, ends
    terraform           event: one of Terraform's -json machine-readable events
    build_step          message, step, total, status: a step of an image build
    push_layer          layer, current, total, status: an image layer being pushed
    code                message, digest, files_sent, bytes_sent, per_node: a user job's code sent to its nodes
    deps                message, created, key(s): a user job's Python environment made or reused
    failed              message, node, exit_code, last_lines: the node that failed first, and its last lines
    restored            message, files: a user job's checkpoint directory restored on a node
    time-limit          message, job_id, continuations, continued: a Slurm job reached its time limit and was
                        requeued to continue its run (continued), or had had its max_continuations
    token / login       message: the dashboard's access token made, and its sign-in link
    request             message, method, path, status, ms: one request to the dashboard (its access log)
    preempted / restarted / resumed / waiting-capacity / start-failed / autostop
                        message, node, jobs: the cluster service's notes (dtrain.service.logic.Note)
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    message: str = ""
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    time: float = dataclasses.field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "time": self.time, **self.data}


class Events:
    """The callback an operation reports to; `Events()` discards everything."""

    def __init__(self, callback: Callable[[Event], None] | None = None) -> None:
        self._callback = callback

    def emit(self, kind: str, message: str = "", **data: Any) -> None:
        if self._callback is not None:
            self._callback(Event(kind, message, data))

    def info(self, message: str) -> None:
        self.emit("info", message)

    def warning(self, message: str) -> None:
        self.emit("warning", message)

    def check(self, message: str, ok: bool) -> None:
        self.emit("check", message, ok=ok)


class Collector(Events):
    """Events kept in a list (tests, services that answer with them later)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        super().__init__(self.events.append)

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


class Stop(enum.IntEnum):
    """What the caller asked for, in rising strength."""

    TERMINATE = 1  # checkpoint and stop (SIGTERM: a preemption, a service shutting down)
    INTERRUPT = 2  # stop soon (Ctrl-C)
    KILL = 3  # stop now (a second Ctrl-C)


class Handle:
    """Cancels a running operation from another thread or a signal handler.

    The operation either polls `take()` (each request once, in order) or subscribes a callback
    that runs at request time. Requests are never lost: one made before the operation looks is
    still there when it does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Stop] = []
        self._subscribers: list[Callable[[Stop], None]] = []
        self.strongest: Stop | None = None

    def request(self, stop: Stop) -> None:
        with self._lock:
            self._pending.append(stop)
            self.strongest = stop if self.strongest is None else max(self.strongest, stop)
            subscribers = list(self._subscribers)
        for fn in subscribers:
            fn(stop)

    def interrupt(self) -> None:
        """Ctrl-C: the first asks for a prompt stop, a second for an immediate one."""
        self.request(Stop.KILL if self.strongest is not None and self.strongest >= Stop.INTERRUPT else Stop.INTERRUPT)

    def terminate(self) -> None:
        self.request(Stop.TERMINATE)

    def kill(self) -> None:
        self.request(Stop.KILL)

    def take(self) -> list[Stop]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    @property
    def stopped(self) -> bool:
        return self.strongest is not None

    def subscribe(self, fn: Callable[[Stop], None]) -> Callable[[], None]:
        """Call fn(stop) on each future request; returns the function that unsubscribes."""
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe
