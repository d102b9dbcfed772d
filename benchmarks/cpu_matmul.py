"""fp32 matrix products of dtrain's LoRA step on this CPU: torch.mm (MKL) against oneDNN's linear.

    python benchmarks/cpu_matmul.py [--threads 2] [--tokens 2048] [--repeats 5]

The shapes are those of the tiny-llama preset at batch 8 x seq 256 (2,048 tokens): the fused LoRA
linear's forward `x [W'; A]^T`, its input gradient `gy W'`, and the rank-8 products of its
backward. Each is timed both ways, alternating, and the median of --repeats is printed with its
GFLOP/s. packages/lora/fused.py routes these through oneDNN on CPU because of these figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

RANK = 8
# (in, out) of the preset's projections: q/k/v/o, gate/up, down.
PROJECTIONS = [(256, 256), (256, 688), (688, 256)]


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")


def mkl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


def per_call_us(f: Callable[[], object], calls: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN (mkldnn): nothing to compare")
    t = args.tokens
    warm = torch.randn(t, 1024)
    for _ in range(20):  # let the cores reach their working clock before the first timing
        mkl(warm, warm[:1024])
        onednn(warm, warm[:1024])
    print(f"{'product':<34} {'m x k x n':>18} {'MKL us':>8} {'oneDNN us':>10} {'MKL GF/s':>9} {'oneDNN GF/s':>12}")
    for i, o in PROJECTIONS:
        x, gy = torch.randn(t, i), torch.randn(t, o)
        wa, b, u, gut = torch.randn(o + RANK, i), torch.randn(o, RANK), torch.randn(t, RANK), torch.randn(RANK, t)
        cases = [  # name, (x, w) for x @ w^T, shape m x k x n
            (f"forward x [W';A]^T ({i}->{o})", (x, wa), (t, i, o + RANK)),
            (f"input grad gy W' ({o}->{i})", (gy, wa[:o].t()), (t, o, i)),
            (f"rank-r (gy B)^T ({o})", (b.t(), gy), (RANK, o, t)),
            (f"rank-r gut x ({i})", (gut, x.t()), (RANK, t, i)),
            (f"rank-r u^T gy ({o})", (u.t(), gy.t()), (RANK, t, o)),
        ]
        for name, (a, w), (m, k, n) in cases:
            torch.testing.assert_close(onednn(a, w), mkl(a, w), rtol=1e-4, atol=1e-3)
            calls = max(10, int(2e9 / (m * k * n)))  # about 30 ms of work per timing
            times: dict[str, list[float]] = {"mkl": [], "onednn": []}
            for _ in range(args.repeats):
                times["mkl"].append(per_call_us(lambda a=a, w=w: mkl(a, w), calls))
                times["onednn"].append(per_call_us(lambda a=a, w=w: onednn(a, w), calls))
            us = {lib: statistics.median(v) for lib, v in times.items()}
            gf = {lib: 2 * m * k * n / v / 1e3 for lib, v in us.items()}
            print(
                f"{name:<34} {f'{m}x{k}x{n}':>18} {us['mkl']:>8.0f} {us['onednn']:>10.0f} "
                f"{gf['mkl']:>9.0f} {gf['onednn']:>12.0f}"
            )


if __name__ == "__main__":
    main()
