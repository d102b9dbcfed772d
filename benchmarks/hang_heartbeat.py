"""What the hang-detection heartbeat costs a training step: dtrain.common.progress.beat(step) after every step
(the built-ins' Context.stop_requested, and sdk.log(step=...) on every rank), against no heartbeat.

    python benchmarks/hang_heartbeat.py [--steps 2000] [--step-ms 1,5,20] [--rounds 5]

The same method as benchmarks/preempt_poll.py: a step is a busy wait of --step-ms on the CPU; for each
step length, --steps steps with and without the heartbeat in turn, --rounds times (every other round in
reverse order, so the machine's drift favours neither), and the median per-step time of each. The
heartbeat is local to the rank (a file rewritten at most once a second; no communication), so one process
measures it. Also prints the mean cost of one call that writes nothing (the usual case: throttled) and of
one that writes the file (tmp file + rename).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # noqa: E402 - run from a checkout too

from dtrain.common.progress import Heartbeat  # noqa: E402

SOLO_CALLS = 20_000
MODES = ("none", "heartbeat")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed_steps(mode: str, steps: int, step_s: float, beat: Heartbeat) -> float:
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        spin(step_s)
        if mode == "heartbeat":
            beat(step)
    return (time.perf_counter() - t0) / steps


def measure(steps: int, step_ms: list[float], rounds: int, directory: str) -> list[str]:
    beat = Heartbeat(directory, "0")
    t0 = time.perf_counter()
    for i in range(SOLO_CALLS):
        beat(i)
    throttled_us = (time.perf_counter() - t0) / SOLO_CALLS * 1e6
    writer = Heartbeat(directory, "1", every_s=0.0)
    t0 = time.perf_counter()
    for i in range(1000):
        writer(i)
    write_us = (time.perf_counter() - t0) / 1000 * 1e6
    lines = [f"one beat() that writes nothing: {throttled_us:.2f} us; one that rewrites the file: {write_us:.0f} us"]
    for ms in step_ms:
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                per_mode[mode].append(timed_steps(mode, steps, ms / 1000, beat))
        med = {m: statistics.median(v) * 1000 for m, v in per_mode.items()}
        spread = (max(per_mode["none"]) - min(per_mode["none"])) / statistics.median(per_mode["none"])
        lines.append(
            f"step {ms:g} ms: none {med['none']:.4f} ms/step, heartbeat {med['heartbeat']:.4f} "
            f"({(med['heartbeat'] - med['none']) / med['none']:+.2%}; rounds without it spread {spread:.2%})"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="steps of each kind per round (2000)")
    p.add_argument("--step-ms", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 5.0, 20.0])
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating the order (5)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="dtrain-heartbeat-") as d:
        print(f"{args.rounds} rounds of {args.steps} steps of each kind; heartbeat files in {d}")
        for line in measure(args.steps, args.step_ms, args.rounds, d):
            print(line)


if __name__ == "__main__":
    main()
