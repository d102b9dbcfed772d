"""How long a stop takes, from SIGTERM to the loop's exit, when steps slow down after training started:
the rule before issue 31 (a blocking agreement every k steps, k sized from the step times measured so
far) against `PreemptionPoll` (an agreement in the background about once a PREEMPT_POLL_INTERVAL_S).

    python benchmarks/preempt_stop.py [--fast-ms 10] [--fast-steps 300] [--slow-ms 250] [--rounds 3]

Each trial starts 2 processes with the variables torchrun sets (gloo, this machine). Each step is a
DDP-sized meeting point (a 4 KiB all-reduce, as DDP's gradient all-reduce makes every step one), then a
sleep: --fast-ms for --fast-steps steps, then --slow-ms (checkpoint back-pressure, a slow upload). A few
slow steps in (a different number each round, so the signal falls at a different place in the
interval), rank 1 sends itself SIGTERM; the figure is the time from that signal to the step at which
both ranks leave the loop (the checkpoint's save is not part of it: benchmarks/preempt_save.py times
that). The rules run in turn, A B A B (every other round in reverse order). Prints every setting, each
trial, and per rule the median and the maximum, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

GRADIENT_BYTES = 4096
RULES = ("every k steps (old)", "PreemptionPoll (new)")
OLD_INTERVAL_S, OLD_MAX_STEPS = 1.0, 100  # the old rule's PREEMPT_POLL_INTERVAL_S and PREEMPT_POLL_MAX_STEPS


class EveryKSteps:
    """The rule before issue 31, as it was (the baseline): a blocking agreement on (flag, s/step) every
    k steps, k = interval / the slowest s/step since the previous agreement."""

    def __init__(self, d, watch) -> None:
        self.d, self.watch, self.next_step, self.last = d, watch, None, None

    def __call__(self, step: int) -> bool:
        if self.next_step is not None and step < self.next_step:
            return False
        now = time.perf_counter()
        per_step = (now - self.last[1]) / max(1, step - self.last[0]) if self.last else 0.0
        flag, slowest = self.d.max_of(1.0 if self.watch.requested else 0.0, per_step)
        every = 1 if slowest <= 0 else max(1, min(OLD_MAX_STEPS, int(OLD_INTERVAL_S / slowest)))
        self.next_step, self.last = step + every, (step, now)
        return flag > 0

    def close(self) -> None:
        pass


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from dtrain.common.config import Backend
    from dtrain.common.dist import distributed
    from dtrain.common.preempt import PreemptionPoll, PreemptionWatch

    torch.set_num_threads(1)
    grads = torch.zeros(GRADIENT_BYTES // 4)
    rank = int(os.environ["RANK"])
    signal_at = args.fast_steps + args.signal_after
    with distributed(Backend.GLOO, 120.0) as d:
        watch = PreemptionWatch()
        poll = EveryKSteps(d, watch) if args.rule == 0 else PreemptionPoll(d, watch)
        signalled = 0.0
        with watch:
            for step in range(1, 10**6):
                dist.all_reduce(grads)
                time.sleep((args.fast_ms if step <= args.fast_steps else args.slow_ms) / 1000)
                if rank == 1 and step == signal_at:
                    signalled = time.time()
                    os.kill(os.getpid(), signal.SIGTERM)
                if poll(step):
                    break
        stopped = time.time()
        poll.close()
    print(json.dumps({"rank": rank, "step": step, "signalled": signalled, "stopped": stopped}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(args: argparse.Namespace, rule: int, signal_after: int) -> tuple[float, int]:
    """Seconds from rank 1's SIGTERM to the later of the two ranks' exits from the loop, and the step."""
    port, procs = str(free_port()), []
    extra = ["--rule", str(rule), "--signal-after", str(signal_after), "--fast-ms", str(args.fast_ms),
             "--fast-steps", str(args.fast_steps), "--slow-ms", str(args.slow_ms)]  # fmt: skip
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *extra], env=env,
                                      stdout=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"error: a worker failed (exit codes {[p.returncode for p in procs]})")
    r0, r1 = (json.loads(o.strip().splitlines()[-1]) for o in outs)
    if r0["step"] != r1["step"]:
        sys.exit(f"error: the ranks stopped at different steps ({r0['step']}, {r1['step']})")
    return max(r0["stopped"], r1["stopped"]) - r1["signalled"], r0["step"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast-ms", type=float, default=10.0, help="step length before the slow-down (10)")
    p.add_argument("--fast-steps", type=int, default=300, help="fast steps (300)")
    p.add_argument("--slow-ms", type=float, default=250.0, help="step length after it (250)")
    p.add_argument("--rounds", type=int, default=3, help="trials of each rule, alternating the order (3)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rule", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--signal-after", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fast_ms <= 0 or args.slow_ms <= 0 or args.fast_steps < 1 or args.rounds < 1:
        p.error("--fast-ms and --slow-ms must be > 0, --fast-steps and --rounds >= 1")
    if args.worker:
        worker(args)
        return
    from dtrain.common.preempt import PREEMPT_POLL_INTERVAL_S, stop_bound_s

    bound = stop_bound_s(PREEMPT_POLL_INTERVAL_S, args.slow_ms / 1000)
    print(f"2 processes, gloo; {args.fast_steps} steps of {args.fast_ms:g} ms, then steps of {args.slow_ms:g} ms; "
          f"old rule: interval {OLD_INTERVAL_S} s, k <= {OLD_MAX_STEPS}; new: PREEMPT_POLL_INTERVAL_S "
          f"{PREEMPT_POLL_INTERVAL_S} s, bound stop_bound_s = {bound:.2f} s; {args.rounds} rounds")  # fmt: skip
    took: dict[int, list[float]] = {0: [], 1: []}
    for r in range(args.rounds):
        signal_after = 2 + 3 * r  # the signal at a different place in the interval each round
        for rule in (0, 1) if r % 2 == 0 else (1, 0):
            seconds, step = trial(args, rule, signal_after)
            took[rule].append(seconds)
            print(f"round {r + 1} {RULES[rule]}: SIGTERM after slow step {signal_after}, stopped at step {step}, "
                  f"{seconds:.2f} s")  # fmt: skip
    med = {rule: statistics.median(v) for rule, v in took.items()}
    for rule in (0, 1):
        print(f"{RULES[rule]}: median {med[rule]:.2f} s, max {max(took[rule]):.2f} s from SIGTERM to the stop")
    print(f"old / new (medians): {med[0] / med[1]:.1f}x")


if __name__ == "__main__":
    main()
