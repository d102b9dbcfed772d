"""The loss curve with LoRA weights in fp32 (peft's default) against bf16 (--adapter-dtype bf16), on
the CPU under bf16 autocast with bf16 base weights, as a GPU run holds them.

    python benchmarks/adapter_dtype.py [--steps 60]

Both sides: the tiny-llama shape, the same seed, the same LoRA initialisation (the bf16 side is the
fp32 weights rounded), the same batches of a repeated text (so the loss can fall far), AdamW at lr 2e-4
(dtrain's default), dtrain's chunked loss. Prints the loss every 10 steps for both and the final gap.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from dtrain.lora.model import PRESETS, apply_lora
from dtrain.lora.train import lm_loss


def run(adapter_dtype: torch.dtype, steps: int, lr: float) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    p = PRESETS["tiny-llama"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(p.family, **p.kwargs), attn_implementation="sdpa", dtype=torch.bfloat16
    )
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.data = q.data.to(adapter_dtype)
    opt = torch.optim.AdamW(params, lr=lr, fused=True)
    text = ("The quick brown fox jumps over the lazy dog. " * 40).encode()
    data = torch.tensor(list(text))
    g = torch.Generator().manual_seed(1)
    losses = []
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 129, (4,), generator=g)
        x = torch.stack([data[s : s + 128] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fp32 = run(torch.float32, args.steps, args.lr)
    bf16 = run(torch.bfloat16, args.steps, args.lr)
    print(f"tiny-llama, bf16 base under bf16 autocast, AdamW lr {args.lr}, 4 x 128 tokens a step")
    print(f"{'step':>5} {'fp32 adapter':>13} {'bf16 adapter':>13} {'gap':>8}")
    for i in [0, *range(9, args.steps, 10)]:
        print(f"{i + 1:5d} {fp32[i]:13.4f} {bf16[i]:13.4f} {bf16[i] - fp32[i]:+8.4f}")
    last = slice(-10, None)
    a, b = sum(fp32[last]) / 10, sum(bf16[last]) / 10
    print(f"mean of the last 10 steps: fp32 {a:.4f}, bf16 {b:.4f} ({b - a:+.4f}); first step {fp32[0]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
