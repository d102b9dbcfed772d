"""Checkpoints that are visible only when complete, written in the background.

Layout under the run (a local directory or a gs:// prefix, through one Store API):

    checkpoints/step-00000120/state.pt    model, optimizer, scheduler, scaler, data position,
                                           step, config, and every rank's RNG state
    checkpoints/step-00000120/meta.json   written after state.pt: step, epoch, model config and
                                           its digest, each file's size and sha256
    checkpoints/LATEST                     the step directory's name, written last

A reader trusts a step only if meta.json exists and every file it lists has the listed size and
checksum, so a save interrupted at any point is never picked up: the newest complete step wins.
Rank 0 writes; every rank reads. Serialisation happens on the training thread (a consistent
snapshot); the write/upload runs on a background thread so training does not wait on the
network, except for the final save and the save on SIGTERM, which are waited for.

A failed write is reported at the next save (or at the end), on every rank at once: rank 0 tells
the others through the collective the save makes anyway, so they stop with it instead of waiting
for a peer that has gone. A full disk is one line (the file, the bytes it needed, and which
checkpoint is intact); the partial step directory is removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.common import env as envmod
from dtrain.common.dist import Dist
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.rundir import LATEST, META_FILE, STEP_RE, complete_meta, config_diff, find_latest, step_dir
from dtrain.common.storage import DiskFull, Store

STATE_FILE = "state.pt"


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_tuple(x: Any) -> Any:
    # random.setstate wants tuples all the way down; serialisation may hand back lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class Checkpointer:
    """`load()` once, `save(step, ...)` every step (it decides whether to act), `close()` at the end."""

    def __init__(
        self,
        store: Store,
        d: Dist,
        *,
        every: int,
        keep: int,
        model_config: dict[str, Any],
        run_config: dict[str, Any],
        log: Callable[[str], None] = print,
        before_save: Callable[[], None] = lambda: None,
        on_event: Callable[..., None] = lambda *_a, **_k: None,
    ) -> None:
        self.store = store  # the run's checkpoints/ prefix
        self.d = d
        self.every = every
        self.keep = keep
        self.model_config = model_config
        self.run_config = run_config
        self.log = log
        # (step, kind, message, **fields) on rank 0 when a checkpoint is loaded ("resumed") or committed
        # ("checkpoint"): the run's events (Reporter.event).
        self.on_event = on_event
        # Called on rank 0 before each save, so files that describe the run up to this step
        # (metrics.jsonl) are never behind the checkpoint a resume starts from.
        self.before_save = before_save
        self.last_saved_step = -1
        self._error: BaseException | None = None
        self._queue: queue.Queue[tuple[int, bytes, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        if d.is_main:
            self._thread = threading.Thread(target=self._writer, name="dtrain-checkpoint", daemon=True)
            self._thread.start()

    # -- reading ------------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """The newest complete checkpoint's state on every rank (RNG already restored), or None."""
        found = find_latest(self.store, self.log if self.d.is_main else lambda _m: None)
        if found is None:
            return None
        saved_cfg = found.meta.get("model_config")
        if saved_cfg != self.model_config:
            raise UserError(
                f"checkpoint {self.store.join(found.name)} has a different model config "
                f"({config_diff(saved_cfg or {}, self.model_config)}): resume with the run's own model "
                "settings, or start a new run without --resume"
            )
        data = self.store.read_bytes(f"{found.name}/{STATE_FILE}")
        want = found.meta["files"][STATE_FILE]["sha256"]
        if hashlib.sha256(data).hexdigest() != want:
            raise UserError(
                f"checkpoint {self.store.join(found.name)} is corrupt (checksum mismatch): "
                "delete that step directory to fall back to the one before"
            )
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        rngs = state.get("rng") or []
        if len(rngs) == self.d.world_size:
            set_rng_state(rngs[self.d.rank], self.d.device)
        else:
            # A different world size cannot replay the old per-rank streams; derive fresh ones.
            seed = int(self.run_config.get("seed", 0)) * 1_000_003 + state["step"] * 101 + self.d.rank
            random.seed(seed)
            torch.manual_seed(seed)
            if self.d.is_main:
                self.log(
                    f"checkpoint was written by {len(rngs)} ranks, this run has {self.d.world_size}: "
                    "RNG streams re-seeded, so results will not be bit-identical to an unbroken run"
                )
        self.last_saved_step = state["step"]
        self.log(f"resuming from {self.store.join(found.name)} (step {state['step']})")
        if self.d.is_main:
            self.on_event(state["step"], "resumed", f"resumed from step {state['step']}", world_size=self.d.world_size)
        return state

    # -- writing ------------------------------------------------------------------------------

    def due(self, step: int, *, epoch_end: bool = False, last: bool = False) -> bool:
        if step == self.last_saved_step:
            return False
        return last or epoch_end or (self.every > 0 and step % self.every == 0)

    def save(
        self,
        step: int,
        state_fn: Callable[[], dict[str, Any]],
        *,
        epoch_end: bool = False,
        last: bool = False,
        collective: bool = False,
    ) -> bool:
        """Checkpoint if due. Every rank calls this at the same steps (it gathers RNG states).
        `last` (end of training, SIGTERM) also waits until the checkpoint is committed. Raises on
        every rank if rank 0's previous write failed. `collective`: `state_fn` gathers from every
        rank (a sharded model), so every rank calls it and rank 0 keeps what it returns."""
        if not self.due(step, epoch_end=epoch_end, last=last):
            if last:
                self._wait_together()
            return False
        gathered = self.d.gather((rng_state(self.d.device), self._settle(flush=True)))
        self._raise_shared(gathered[0][1])
        state = state_fn() if collective or self.d.is_main else None
        if self.d.is_main:
            assert state is not None
            rngs = [rng for rng, _ in gathered]
            state.update(step=step, rng=rngs, config=self.run_config, model_config=self.model_config)
            buf = io.BytesIO()
            torch.save(state, buf)
            meta = {
                "step": step,
                "epoch": state.get("data", {}).get("epoch"),
                "model_config": self.model_config,
                "config_digest": digest(self.model_config),
                "world_size": self.d.world_size,
                "created": time.time(),
            }
            self._idle.clear()
            self._queue.put((step, buf.getvalue(), meta))
        self.last_saved_step = step
        if last:
            self._wait_together()
        return True

    def wait(self) -> None:
        """Block until every queued checkpoint is committed (rank 0); re-raise a writer failure."""
        if self.d.is_main:
            self._idle.wait()
            self._raise_if_failed()

    def _settle(self, *, flush: bool = False) -> str | None:
        """Rank 0: wait for the write in flight (at most one: bounded memory, ordered commits),
        then, with `flush`, bring the run's other files up to this step. Returns what failed, for
        the other ranks, or None; on other ranks, None."""
        if not self.d.is_main:
            return None
        self._idle.wait()
        if flush and self._error is None:
            try:
                self.before_save()
            except DiskFull as e:
                self._error = self._disk_full(e, None)
        return None if self._error is None else str(self._error)

    def _wait_together(self) -> None:
        """Every rank: wait until rank 0 has committed, and raise together if it could not."""
        self._raise_shared(self.d.broadcast(self._settle()))

    def _raise_shared(self, failure: str | None) -> None:
        if failure is None:
            return
        if self.d.is_main:
            self._raise_if_failed()
        # Rank 0 reports the failure; the others stop with the same exit code and print nothing.
        raise UserError(failure, exit_code=ExitCode.FAILURE)

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, UserError):
                raise err
            raise RuntimeError(f"writing a checkpoint to {self.store.url} failed: {err}") from err

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, data, meta = item
            try:
                self._commit(step, data, meta)
            except DiskFull as e:
                self._error = self._disk_full(e, step)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._idle.set()

    def _commit(self, step: int, data: bytes, meta: dict[str, Any]) -> None:
        name = step_dir(step)
        self.store.write_bytes(f"{name}/{STATE_FILE}", data)
        pause = envmod.fault_pause_before_commit()
        if pause:
            time.sleep(pause)
        meta["files"] = {STATE_FILE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        self.store.write_bytes(f"{name}/{META_FILE}", json.dumps(meta, indent=1).encode())
        self.store.write_bytes(LATEST, name.encode())
        self.on_event(step, "checkpoint", f"checkpoint step {step} saved", bytes=len(data))
        self._prune(step)

    def _disk_full(self, e: DiskFull, step: int | None) -> Exception:
        """The one line for a save that filled the disk, after removing the step directory it
        left incomplete: a reader would skip it anyway, and it holds space the user needs back.
        If looking at the store fails as well, the bare error (raised with its traceback)."""
        try:
            return self._disk_full_error(e, step)
        except Exception:  # noqa: BLE001 - the disk error is the one to report
            return e

    def _disk_full_error(self, e: DiskFull, step: int | None) -> UserError:
        if step is not None and complete_meta(self.store, step_dir(step)) is None:
            self.store.delete(step_dir(step))
        found = find_latest(self.store)
        intact = (
            f"checkpoint step {found.step} ({self.store.join(found.name)}) is intact: free space and resume from it"
            if found
            else "no earlier checkpoint: free space and start again"
        )
        return UserError(
            f"disk full: writing {e.path} needed {e.needed:,} bytes, {e.free:,} were free; {intact}",
            exit_code=ExitCode.FAILURE,
        )

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep` complete checkpoints; drop older ones and any older debris."""
        names = sorted({p.split("/", 1)[0] for p in self.store.list("") if STEP_RE.match(p.split("/", 1)[0])})
        complete = [n for n in names if complete_meta(self.store, n) is not None]
        keep = set(complete[-self.keep :])
        for n in names:
            if n not in keep and int(STEP_RE.match(n).group(1)) < newest:  # type: ignore[union-attr]
                self.store.delete(n)
