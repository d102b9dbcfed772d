"""What agreeing on the SIGTERM flag costs a training step: dtrain's `Dist.any` (a one-element
all-reduce over the gloo group, a blocking round trip through every rank) after every step, against
no poll and against `PreemptionPoll` (the flag agreed on about once a PREEMPT_POLL_INTERVAL_S).

    python benchmarks/preempt_poll.py [--nproc 2] [--steps 400] [--step-ms 1,5,20] [--rounds 5]

It starts --nproc processes with the variables torchrun sets (gloo, this machine) and times, for each
step length, --steps steps of each kind in turn, --rounds times (every other round in reverse order,
so the machine's drift favours none). A step is a busy wait of --step-ms on the CPU (on a GPU it
would be the time the CPU spends enqueuing a step) followed by an all-reduce of 4 KiB: DDP's gradient
all-reduce makes every step a meeting point anyway, and a small one keeps its own time out of the
way. Prints, per step length, the median per-step time of each kind and what the per-step poll
adds; and the mean cost of one `Dist.any` call on its own. benchmarks/README.md has the figures
measured here.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

GRADIENT_BYTES = 4096  # what stands in for DDP's gradient all-reduce each step: a meeting point, kept small
SOLO_CALLS = 2000  # back-to-back Dist.any calls timed on their own
MODES = ("none", "every step", "PreemptionPoll")


def spin(seconds: float) -> None:
    """Busy for `seconds` of wall time: a step's fixed amount of work, unaffected by how fast the
    machine happens to be this minute."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed_steps(d, mode: str, steps: int, step_s: float, grads) -> float:
    """Seconds per step of `steps` steps of `mode`, every rank starting together."""
    import torch.distributed as dist

    from dtrain.common.preempt import PreemptionPoll, PreemptionWatch

    poll = PreemptionPoll(d, PreemptionWatch())
    d.barrier("round")
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        spin(step_s)
        dist.all_reduce(grads)
        if mode == "every step":
            d.any(False)
        elif mode == "PreemptionPoll":
            poll(step)
    dt = time.perf_counter() - t0
    poll.close()  # meets any post a peer has not (collective; outside the timed steps)
    return dt / steps


def worker(args: argparse.Namespace) -> None:
    import torch

    from dtrain.common.config import Backend
    from dtrain.common.dist import distributed

    torch.set_num_threads(1)
    grads = torch.zeros(GRADIENT_BYTES // 4)
    with distributed(Backend.GLOO, 120.0) as d:
        for _ in range(100):  # connections and allocator warm
            d.any(False)
        t0 = time.perf_counter()
        for _ in range(SOLO_CALLS):
            d.any(False)
        solo_us = (time.perf_counter() - t0) / SOLO_CALLS * 1e6
        lines = []
        for step_ms in args.step_ms:
            per_mode: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    per_mode[mode].append(timed_steps(d, mode, args.steps, step_ms / 1000, grads))
            med = {m: statistics.median(v) * 1000 for m, v in per_mode.items()}
            added = med["every step"] - med["none"]
            lines.append(
                f"step {step_ms:g} ms (+ 4 KiB all-reduce): no poll {med['none']:.3f} ms/step, "
                f"Dist.any every step {med['every step']:.3f} (+{added * 1000:.0f} us, "
                f"{added / med['none']:+.1%}), PreemptionPoll {med['PreemptionPoll']:.3f} "
                f"({(med['PreemptionPoll'] - med['none']) / med['none']:+.1%})"
            )
        if d.is_main:
            print(f"{d.world_size} processes, gloo, {args.rounds} rounds of {args.steps} steps of each kind")
            print(f"one Dist.any on its own: {solo_us:.0f} us (mean of {SOLO_CALLS} back to back)")
            for line in lines:
                print(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (2)")
    p.add_argument("--steps", type=int, default=400, help="steps of each kind per round (400)")
    p.add_argument("--step-ms", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 5.0, 20.0])
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating the order (5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nproc < 2 or args.steps < 1 or args.rounds < 1:
        p.error("--nproc must be >= 2, --steps and --rounds >= 1")
    if args.worker:
        worker(args)
        return
    port, procs = str(free_port()), []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *(argv or sys.argv[1:])], env=env))
    codes = [proc.wait() for proc in procs]
    if any(codes):
        sys.exit(f"error: a worker failed (exit codes {codes})")


if __name__ == "__main__":
    main()
