"""Hang detection for a job on this machine (docs/hangs.md). There is no node agent here: the local launcher
(dtrain.control.local for the built-ins, dtrain.control.userjob for users' programs) plays its part with the
agent's own pieces, dtrain.common.nodeagent.HangWatch (the ranks' progress folder and the stacks hook, given
to the job through its environment; progress.Watcher; the stack dump), and does what the cluster launcher
does with an agent's report (the line, the run's hangs/ and events.jsonl, stragglers).

    watch = LocalHangWatch.start(timeout_s, env, run, events, restarts=n, startup_s=s)   # None: detection off
    while the job runs:  action = watch.check(root_pid)                   # None, RESTART or STOP
    watch.error                                                           # status.json's error after a hang

On a hang the stuck rank's stacks (and those of the other late ranks) go to `<run>/hangs/<host>-rank<r>.txt`,
and one line and a "hang" event name the host, the rank, its last step and the file. Then, while torchrun has
restarts left (`--max-restarts`, counted in the rank's TORCHELASTIC_RESTART_COUNT), the ranks are killed and
torchrun starts them again, continuing from the last complete checkpoint as after a crash (on one machine
torchrun's restarts are dtrain's, docs/decisions.md); otherwise the caller stops the whole job (RESTART/STOP).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time
from typing import Any

from dtrain.common.progress import StragglerSet
from dtrain.common.storage import Store
from dtrain.control.events import Events


class Action(enum.Enum):
    RESTART = "restart"  # the ranks were killed: torchrun starts them again
    STOP = "stop"  # the caller stops the job (SIGTERM, SIGKILL HANG_GRACE_S later); it ends ExitCode.HUNG


class LocalHangWatch:
    def __init__(
        self,
        timeout_s: float | None,
        env: dict[str, str],
        run: Store,
        events: Events,
        restarts: int,
        startup_s: float | None = None,
    ) -> None:
        from dtrain.common.nodeagent import HangWatch

        self.agent = HangWatch({"hang": {"timeout_s": timeout_s, "startup_s": startup_s}}, env)
        # One machine: no other node to let speak first, so a rank that is not stopped is judged as soon as
        # its timeout has passed.
        self.agent.watcher.settle_s = 0.0
        self.run, self.events, self.restarts = run, events, restarts
        self.host = self.agent.host
        self.error = ""  # set when the job ends because of a hang (status.json's "error")
        self._restarted: set[int] = set()  # pids of the ranks killed for torchrun to restart
        self._polled_at = -float("inf")
        self._stragglers = StragglerSet()
        self.pids: list[int] = []  # the job's processes at the last poll: what to sweep at the end

    @classmethod
    def start(
        cls,
        timeout_s: float | None,
        env: dict[str, str],
        run: Store,
        events: Events,
        *,
        restarts: int,
        startup_s: float | None = None,
    ) -> LocalHangWatch | None:
        """The watch, its variables put into `env` (the job's); None when `timeout_s` is 0 (detection off).
        `startup_s`: the start-up bound (None: progress.STARTUP_TIMEOUT_S, 0: none of its own)."""
        if timeout_s == 0:
            return None
        return cls(timeout_s, env, run, events, restarts, startup_s)

    def check(self, root: int) -> Action | None:
        """Look at the job's ranks (at most every nodeagent.WATCH_EVERY_S); what the caller must do now."""
        from dtrain.common.nodeagent import WATCH_EVERY_S, tree

        if time.monotonic() - self._polled_at < WATCH_EVERY_S:
            return None
        self._polled_at = time.monotonic()
        self.pids = tree(root)
        hang = self.agent.watcher.poll(self.pids)
        if self._restarted and any(rk.pid not in self._restarted for rk in self.agent.watcher.ranks.values()):
            self._restarted.clear()  # torchrun started the ranks again: the hang is behind us
            self.error = ""
        self._note_stragglers()
        if hang is None or self._restarted:
            return None
        return self._act(hang)

    def _act(self, hang: Any) -> Action:
        from dtrain.common.metrics import record_event
        from dtrain.common.nodeagent import signal_tree
        from dtrain.common.progress import env_value, hang_error, hang_line

        rk = hang.rank
        where = self._save_stacks(hang)
        line = hang_line(self.host, rk.rank, hang.age_s, rk.step, where, startup=hang.startup)
        facts = {"node": self.host, "rank": rk.rank, "age_s": round(hang.age_s, 1),
                 "timeout_s": round(hang.timeout_s, 1), "state": rk.state, "stacks": where, **hang.facts()}  # fmt: skip
        self.error = hang_error({**facts, "step": rk.step})
        self.events.emit("hang", line, step=rk.step, **facts)
        record_event(self.run, rk.step, "hang", line, **facts)
        used = env_value(rk.pid, "TORCHELASTIC_RESTART_COUNT")
        if used is None or not used.isdigit() or int(used) >= self.restarts:
            return Action.STOP
        self.events.info(
            f"dtrain: the job hung; torchrun starts its processes again from the last complete checkpoint "
            f"(restart {int(used) + 1} of {self.restarts})"
        )
        ranks = list(self.agent.watcher.ranks.values())
        self._restarted = {r.pid for r in ranks}
        for r in ranks:
            signal_tree(r.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            # Its heartbeat is the old generation's: the restarted rank starts without one.
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.agent.dir, f"rank-{r.rank}"))
        return Action.RESTART

    def _save_stacks(self, hang: Any) -> str:
        """The late ranks' stacks into the run; where the stuck rank's are (or what became of them)."""
        stacks = self.agent.dump(hang.others)
        where = "(not saved: the run could not be written)"
        for rank, text in stacks.items():
            rel = f"hangs/{self.host}-rank{rank}.txt"
            with contextlib.suppress(Exception):  # the line must come out, whatever the store says
                self.run.write_bytes(rel, text.encode())
                if rank == hang.rank.rank:
                    where = self.run.join(rel)
        return where

    def _note_stragglers(self) -> None:
        from dtrain.common.metrics import record_event

        message = self._stragglers.update(self.host, self.agent.watcher.medians())
        if message is not None:
            found = self._stragglers.now
            self.events.emit("straggler", message, stragglers=found)
            record_event(self.run, None, "straggler", message, stragglers=found)

    def sweep(self) -> None:
        """SIGKILL to whatever of the job is left (torchrun's workers live in sessions of their own)."""
        for p in self.pids[1:]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)

    def close(self) -> None:
        self.agent.close()


__all__ = ["Action", "LocalHangWatch"]
