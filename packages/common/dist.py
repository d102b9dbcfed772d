"""Rank, world size, device and backend, worked out once (cf. torchtitan's ParallelDims).

`distributed()` reads torchrun's environment (or runs as a single process without it), picks
nccl with CUDA and gloo without, pins the CUDA device from LOCAL_RANK, sets an explicit collective
timeout, learns which host every rank lives on, and always destroys the process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dtrain.common.config import Backend
from dtrain.common.env import LaunchEnv
from dtrain.common.errors import ExitCode, UserError

T = TypeVar("T")

# How long ranks wait for each other at the end: rank 0 may still be writing the final model
# (a merged LLM uploaded to a bucket takes minutes).
SHUTDOWN_WAIT_S = 3600.0


class PeerFailure(RuntimeError):
    """A collective failed or timed out because another rank died or hung. The message names
    this rank and host, and the peer when it can be told."""


@dataclasses.dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    addr: str = ""  # the address this rank uses to reach the master; gloo names peers by it

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


@dataclasses.dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group
    timeout: datetime.timedelta
    env: LaunchEnv
    peers: list[Peer] = dataclasses.field(default_factory=list)
    _cpu_group: Any = None  # gloo group for object collectives and monitored barriers

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def me(self) -> Peer:
        return self.peers[self.rank] if self.peers else Peer(self.rank, self.env.hostname, os.getpid())

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (e.g. 'a SIGTERM arrived somewhere')."""
        return self.max_of(1.0 if flag else 0.0)[0] > 0

    def max_of(self, *values: float) -> list[float]:
        """Each value's maximum over the ranks, on every rank: one blocking round trip.

        Runs on the CPU (gloo) group: a GPU tensor here would make the host wait for the GPU's
        queue on every call, stalling the pipeline."""
        if self.backend is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return t.tolist()

    def synchronize(self) -> float:
        """Wait for this rank's queued GPU work; returns time.perf_counter() after it. Timers that
        pause around evaluation call this first, or queued training work would go uncounted."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.backend is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.backend is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def all_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers (BatchNorm statistics, say) into `module` on every rank."""
        if self.backend is None:
            return
        for b in module.buffers():
            dist.broadcast(b, src=0)

    def node_first(self, tag: str, fn: Callable[[], T], timeout: float) -> T:
        """`fn()` on every rank, on each node's local rank 0 before the node's other ranks: for work whose
        first run fills a cache on the node (a model download) that the others then read.

        Every rank waits for all the first runs at a barrier of its own `timeout`, not the collective
        timeout, which one slow node's download would exceed. A UserError from a first run is raised on
        every rank, so all exit with its message and code instead of waiting."""
        if self.backend is None:
            return fn()
        result: Any = None
        error: tuple[str, int] | None = None
        if self.local_rank == 0:
            try:
                result = fn()
            except UserError as e:
                error = (str(e), int(e.exit_code))
        self.barrier(tag, timeout=timeout)
        errors = [e for e in self.gather(error) if e is not None]
        if errors:
            raise UserError(errors[0][0], exit_code=ExitCode(errors[0][1]))
        return result if self.local_rank == 0 else fn()

    def barrier(self, tag: str, timeout: float | None = None) -> None:
        """Wait for every rank; if one does not arrive, fail naming it and its host.

        A monitored barrier (gloo) reports which ranks missed it, which a plain barrier or a
        timed-out all-reduce does not."""
        if self.backend is None:
            return
        secs = self.timeout.total_seconds() if timeout is None else timeout
        try:
            dist.monitored_barrier(group=self._cpu_group, timeout=datetime.timedelta(seconds=secs), wait_all_ranks=True)
        except RuntimeError as e:
            raise PeerFailure(self._explain(e, f"barrier '{tag}'", secs)) from e

    def _explain(self, e: BaseException, where: str, secs: float) -> str:
        text = str(e)
        m = re.search(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier", text)
        if m:
            missing = [self._peer(int(r)) for r in re.findall(r"\d+", m.group(1))]
            who = ", ".join(str(p) for p in missing)
            return f"{self.me} waited {secs:g}s at {where} for {who}, which did not arrive (hung or dead)"
        if self.rank != 0:
            return f"{self.me} lost contact with {self._peer(0)} at {where}: {first_line(text)}"
        return f"{self.me}: {where} failed: {first_line(text)}; peers: {self._peer_list()}"

    def _peer(self, rank: int) -> Peer | str:
        return self.peers[rank] if rank < len(self.peers) else f"rank {rank}"

    def _peer_list(self) -> str:
        return ", ".join(str(p) for p in self.peers) or "unknown"

    def describe_failure(self, e: BaseException) -> str:
        """One line for a collective that raised: who we are, what broke, and which peer, when the
        backend's message names its address and only one other rank has it."""
        if isinstance(e, PeerFailure):
            return str(e)
        text = first_line(str(e))
        addr = self._addr_in(text)
        suspects = [p for p in self.peers if p.rank != self.rank and addr and p.addr == addr]
        if len(suspects) == 1:
            who = f"lost {suspects[0]}, which died or became unreachable"
        else:
            others = [p for p in self.peers if p.rank != self.rank]
            who = f"a peer died or became unreachable (peers: {', '.join(map(str, others)) or 'none'})"
        detail = text.split(". This is typically")[0]
        return f"{self.me}: {who}: {detail}"

    @staticmethod
    def _addr_in(text: str) -> str | None:
        # gloo says "... closed by peer [ADDR]:PORT" or "Read error [ADDR]:PORT: Connection reset by peer".
        m = re.search(r"(?:peer \[?|\[)([\w.:-]+?)\]?:\d+", text)
        return m.group(1) if m else None


def route_to(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else "(no message)"


def is_comm_failure(e: BaseException) -> bool:
    """Errors that mean a peer went away or hung, as opposed to a bug in this rank."""
    if isinstance(e, PeerFailure):
        return True
    dist_errors = tuple(c for c in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None)) if c)
    if dist_errors and isinstance(e, dist_errors):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Timed out waiting",
            "timed out",
            "Broken pipe",
            "NCCL communicator was aborted",
            "Gloo",
        )
    )


def pick_device(env: LaunchEnv) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if env.local_rank >= n:
        raise UserError(
            f"LOCAL_RANK {env.local_rank} but this host has {n} GPU(s): use --nproc {n} (one process per GPU)"
        )
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def pick_backend(requested: Backend, device: torch.device) -> str:
    if requested == Backend.AUTO:
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == Backend.NCCL and device.type != "cuda":
        raise UserError("--backend nccl needs CUDA GPUs and none are visible: use --backend gloo or auto")
    return requested.value


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker if its launcher (torchrun's agent) dies.

    torchrun starts each worker in a session of its own, so a launcher killed with SIGKILL would
    otherwise leave workers running, holding ports and GPUs."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@contextlib.contextmanager
def distributed(backend: Backend = Backend.AUTO, timeout_s: float = 300.0) -> Iterator[Dist]:
    """Set up this process's place in the job; always tear the process group down."""
    env = LaunchEnv.read()
    device = pick_device(env)
    timeout = datetime.timedelta(seconds=timeout_s)
    d = Dist(
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
        device=device,
        backend=None,
        timeout=timeout,
        env=env,
    )
    if env.under_launcher:
        die_with_parent()
    try:
        if env.under_launcher:
            d.backend = pick_backend(backend, device)
            kwargs: dict[str, Any] = {"backend": d.backend, "timeout": timeout}
            if device.type == "cuda":
                kwargs["device_id"] = device  # eager NCCL init: a bad GPU fails here, not mid-step
            dist.init_process_group(**kwargs)
            # Object collectives and monitored barriers need a CPU (gloo) group; with gloo it is the
            # default group itself.
            d._cpu_group = dist.new_group(backend="gloo", timeout=timeout) if d.backend == "nccl" else None
            me = {"rank": d.rank, "host": env.hostname, "pid": os.getpid(), "addr": route_to(env.master_addr)}
            d.peers = [Peer(**p) for p in d.gather(me)]
        yield d
        if d.backend is not None:
            # Leave together: a rank that tears its connections down while a peer is still
            # working (rank 0 writing the final model, say) can make the peer's gloo threads
            # abort the process. Only on success: after a failure a peer may never arrive.
            d.barrier("shutdown", timeout=max(timeout_s, SHUTDOWN_WAIT_S))
    finally:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
