"""torch.compile against dtrain's fused eager LoRA step, interleaved in one process.

    python benchmarks/lora_compile_ab.py [--rounds 8] [--steps 3]

Builds the tiny-llama preset twice (seeded alike): A runs dtrain's fused LoRA linears eagerly, B is
stock peft under torch.compile (inductor). It warms both up, then alternates: `--steps` steps of A,
then of B, for `--rounds` rounds, and prints each round's ms/step and the A/B ratio with its median.
Interleaving is the point: on these shared machines the speed drifts 10-20% from minute to
minute, which one-after-the-other runs mistake for a difference (docs/decisions.md, LoRA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dtrain.lora.fused import fuse_lora_linears
from dtrain.lora.model import apply_lora, load_base


def make_step(fused: bool, compiled: bool, batch: int, seq: int) -> Callable[[], None]:
    model, _tok = load_base("tiny-llama", torch.float32, 0)
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    if fused:
        fuse_lora_linears(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    fwd = torch.compile(model, dynamic=False) if compiled else model
    x = torch.randint(0, 256, (batch, seq))

    def step() -> None:
        fwd(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], None], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps of each per round")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    eager, compiled = make_step(True, False, 8, 256), make_step(False, True, 8, 256)
    for _ in range(3):  # warm-up, and the compile
        eager()
        compiled()
    a, b = [], []
    for _ in range(args.rounds):
        a.append(timed(eager, args.steps))
        b.append(timed(compiled, args.steps))
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    print("fused eager ms/step:", [round(1000 * x) for x in a])
    print("compiled    ms/step:", [round(1000 * x) for x in b])
    print("eager/compiled per round:", [round(r, 2) for r in ratios], "median", round(statistics.median(ratios), 3))


if __name__ == "__main__":
    main()
