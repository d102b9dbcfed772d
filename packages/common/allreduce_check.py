"""A short all-reduce across the job, for `dtrain doctor`: run it under torchrun on every node.

    torchrun ... -m dtrain.common.allreduce_check [--mib 64] [--iters 5]

nccl with CUDA, gloo without (dtrain.common.dist's choice). Rank 0 prints one JSON line prefixed
with RESULT_PREFIX: backend, world size, size, time per all-reduce, and the bandwidths as NCCL's
tests define them: algbw = bytes / time, busbw = algbw x 2(n-1)/n (what each link carries in a
ring all-reduce, comparable across world sizes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

RESULT_PREFIX = "dtrain-allreduce "


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtrain.common.allreduce_check")
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=60.0)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from dtrain.common.env import LaunchEnv

    env = LaunchEnv.read()
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=a.timeout_s))
    try:
        n = int(a.mib * 2**20) // 4
        x = torch.ones(n, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections, and the value check below
        if cuda:
            torch.cuda.synchronize()
        ok = bool(torch.all(x == dist.get_world_size()).item())
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / a.iters
        if dist.get_rank() == 0:
            ws = dist.get_world_size()
            algbw = n * 4 / dt
            result = {
                "backend": backend,
                "world_size": ws,
                "mib": a.mib,
                "ms": round(dt * 1000, 2),
                "algbw_gbps": round(algbw / 1e9, 3),
                "busbw_gbps": round(algbw * 2 * (ws - 1) / ws / 1e9, 3),
                "correct": ok,
            }
            print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
