"""A LoRA SFT worker's memory stays flat over steps whose rows differ in length.

Before the fix, every distinct micro-batch length was a new set of matrix shapes for the fused CPU
linear's oneDNN calls, and oneDNN kept what it built for each: the issue's race saw a worker grow from
856 MiB at step 4 to ~1,500 MiB at step 40. The worker here runs 100 steps in a process of its own and
reports its peak resident set (VmHWM, what the race's os.wait4 ru_maxrss reads) after each step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

STEPS, SETTLED_AT = 100, 10
# How much the peak may still rise after SETTLED_AT steps: a row length not met before can still add its
# shapes (at most seq_len / sft.LENGTH_BUCKET of them). Unfixed (columns cut to the exact length), this
# worker rose 407 MiB (654 MiB at step 10, 1,061 at step 100); fixed, 0 (456 and 456).
GROWTH_BOUND_MIB = 24

WORKER = r"""
import contextlib, json, random, sys, types
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from dtrain.lora import sft
from dtrain.lora.fused import fuse_model
from dtrain.lora.train import train_step

steps = int(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
model = LlamaForCausalLM(cfg)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
assert fuse_model(model)["lora_linears"] == 14
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
scaler = torch.amp.GradScaler("cpu", enabled=False)
ctx = types.SimpleNamespace(d=types.SimpleNamespace(device=torch.device("cpu"), world_size=1),
                            precision=types.SimpleNamespace(autocast=contextlib.nullcontext))
rng = random.Random(0)
def example():
    n = rng.randint(16, 256)
    ids = [rng.randrange(512) for _ in range(n)]
    return sft.Example(ids, [sft.IGNORE] + ids[1:], "r")
model.train()
for step in range(steps):
    rows = sft.pack_rows([example() for _ in range(4)], 256, 0, packing=False)  # one example a row
    trained, _ = sft.step_tokens(rows)
    train_step(ctx, model, model, opt, sched, scaler, list(rows.split(1)), 1.0, trained)
    hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    print(json.dumps({"step": step + 1, "peak_mib": hwm / 1024}), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status (Linux)")
def test_peak_memory_is_flat_over_100_steps_of_varying_length():
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(STEPS)], capture_output=True, text=True, timeout=280, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = {r["step"]: r["peak_mib"] for r in map(json.loads, out.stdout.split("\n")[:-1]) if r}
    assert len(peaks) == STEPS
    growth = peaks[STEPS] - peaks[SETTLED_AT]
    assert growth < GROWTH_BOUND_MIB, (
        f"peak RSS rose {growth:.0f} MiB from step {SETTLED_AT} ({peaks[SETTLED_AT]:.0f} MiB) to step {STEPS} "
        f"({peaks[STEPS]:.0f} MiB); bound {GROWTH_BOUND_MIB} MiB"
    )
