"""What the node agent's resource sampling costs (dtrain.common.resources.Sampler.sample: /proc/stat,
/proc/meminfo, each process's /proc/PID/status, NVML where there are GPUs), against the work the agent already
does on every poll (dtrain.common.nodeagent.tree: a walk of /proc to find the job's process tree, twice a
second).

    python benchmarks/resource_sampling.py [--procs 10] [--ranks 2] [--calls 200] [--rounds 5] [--gpus]

It starts --procs processes holding 8 MiB each (--ranks of them with RANK set, as torchrun's workers), then
times --calls calls of each side in turn, --rounds times (every other round in reverse order, so the
machine's drift favours neither), by the calling thread's CPU time (time.thread_time: what the agent pays,
not what the machine's other load adds), and prints the medians: one sample, one tree walk, and what
sampling every 5 s (the default) adds to the agent's own polling, as a share of one core and as a ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # noqa: E402 - run from a checkout too

from dtrain.common.nodeagent import WATCH_EVERY_S, tree  # noqa: E402
from dtrain.common.resources import SAMPLE_EVERY_S, Sampler  # noqa: E402

HOLD = "import time; b = bytearray(8 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); " \
       "time.sleep(600)"  # fmt: skip
AGENT_POLL_S = 0.5  # nodeagent.run's main loop: tree(proc.pid) every 0.5 s


def start_tree(procs: int, ranks: int) -> subprocess.Popen:
    """A root process (a stand-in for torchrun) with `procs` children, the first `ranks` of them with RANK."""
    code = (
        "import os, subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {HOLD!r}], stdout=subprocess.PIPE, text=True,\n"
        f"        env={{**os.environ, **({{'RANK': str(i)}} if i < {ranks} else {{}})}}) for i in range({procs})]\n"
        "for k in kids: k.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert root.stdout is not None and root.stdout.readline().strip() == "ready"
    return root


def cpu_per_call(fn, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpus", action="store_true", help="sample the GPUs too (NVML), as the agent does")
    a = ap.parse_args()
    root = start_tree(a.procs, a.ranks)
    try:
        pids = tree(root.pid)
        sampler = Sampler(gpus=a.gpus)
        row = sampler.sample(pids)
        print(f"settings: procs={a.procs} ranks={a.ranks} calls={a.calls} rounds={a.rounds} gpus={a.gpus} "
              f"(NVML: {'yes' if sampler.gpus and sampler.gpus.nvml else sampler.gpus.why if sampler.gpus else 'off'})"
              f"; /proc has {sum(1 for d in os.listdir('/proc') if d.isdigit())} processes; "
              f"tree: {len(pids)} processes, ranks seen {sorted(row['ranks'])}")  # fmt: skip
        sides = {"tree walk": lambda: tree(root.pid), "sample": lambda: sampler.sample(pids)}
        got: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(a.rounds):
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                got[name].append(cpu_per_call(sides[name], a.calls))
        sampler.close()
    finally:
        for p in reversed(tree(root.pid)):
            os.kill(p, 9)
        root.wait()
    walk, sample = (statistics.median(got[k]) * 1000 for k in sides)
    for k in sides:
        print(f"{k}: median {statistics.median(got[k]) * 1000:.3f} ms CPU a call "
              f"(rounds: {', '.join(f'{x * 1000:.3f}' for x in got[k])})")  # fmt: skip
    polling = walk / AGENT_POLL_S  # ms of CPU a second the agent already spends finding its job's processes
    sampling = sample / SAMPLE_EVERY_S
    print(
        f"every {SAMPLE_EVERY_S:.0f} s: {sampling:.4f} ms CPU a second = {sampling / 10:.5f} % of one core; "
        f"the agent's tree walk every {AGENT_POLL_S} s: {polling:.4f} ms a second; sampling adds "
        f"{sampling / polling:.3f}x of that (the hang watch's own walk every {WATCH_EVERY_S:.0f} s not counted)"
    )


if __name__ == "__main__":
    main()
