"""The memory plan (dtrain.lora.plan) against measured peak memory, on the CPU, for small real models.

    python benchmarks/memory_plan.py            # the configurations below, a table of planned vs measured
    python benchmarks/memory_plan.py --json out.json

Each configuration builds a real architecture from its transformers config (Llama, Qwen2, Mistral:
a few layers, a small hidden size, random weights), wraps it with peft LoRA on the seven projections,
and runs forward, backward and an AdamW step twice; the second step is measured (AdamW's moments
exist by then, as in every step after the first). fp32 runs plain, bf16 runs the base weights in bf16
under CPU autocast, which casts and saves as CUDA autocast does.

How the peak is measured: every tensor an operator reads or makes passes through a
TorchDispatchMode (LiveBytes), which counts the bytes of its storage once, from the moment it is
first seen until Python's weak reference to the storage dies, which happens only when the storage is
freed (torch keeps a storage's Python object alive while C++ holds the storage: autograd's saved
tensors, gradients). Parameters, buffers, optimizer state and the input are counted at the start. The
peak is the largest sum over the step. That is exactly what the CPU allocator hands out to tensors (it
neither rounds nor caches), with none of RSS's noise: the interpreter, libraries, and pages freed
but kept by malloc. It is the "allocated" figure of the plan, without the GPU-only overheads (CUDA
context, caching allocator rounding, cuBLAS workspaces), which need a GPU to measure.

What the CPU run does not see: GPU kernels. SDPA on the CPU (its flash kernel) keeps what CUDA's
flash and memory-efficient kernels keep (q, k, v, the output and a log-sum-exp); the plan's
T4/V100 case (grouped k/v heads repeated) is not exercised here. dtrain's CPU-only fused LoRA
kernels (dtrain.lora.fused) are not used: the plan is for the stock transformers + peft step that
runs on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtrain.lora import plan as lp

TARGETS = list(lp.LLAMA_TARGETS)
# Small real shapes, one per family; grouped k/v heads in all but the first, tied embeddings in Qwen2's.
FAMILIES = {
    "llama": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=2048),
    "qwen2": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=3000, tie_word_embeddings=True),
    "mistral": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=2500, sliding_window=None),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    family: str
    precision: str  # fp32 or bf16
    checkpointing: bool
    seq_len: int
    batch: int
    rank: int = 8
    shape: dict | None = None  # config fields over FAMILIES[family] (the tests use smaller ones)

    @property
    def name(self) -> str:
        ckpt = "ckpt" if self.checkpointing else "no-ckpt"
        return f"{self.family} {self.precision} {ckpt} seq {self.seq_len} x {self.batch}"


CASES = (
    Case(family="llama", precision="fp32", checkpointing=False, seq_len=256, batch=2),
    Case(family="llama", precision="fp32", checkpointing=True, seq_len=512, batch=2),
    Case(family="qwen2", precision="bf16", checkpointing=False, seq_len=256, batch=2),
    Case(family="qwen2", precision="bf16", checkpointing=True, seq_len=512, batch=1),
    Case(family="mistral", precision="bf16", checkpointing=False, seq_len=128, batch=4),
    Case(family="mistral", precision="fp32", checkpointing=True, seq_len=256, batch=2, rank=16),
)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, over what runs inside it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, size = st._cdata, st.nbytes()
        old = self.sizes.get(key)
        if old is not None:
            if old != size:  # resized in place
                self.current += size - old
                self.sizes[key] = size
            return
        self.sizes[key] = size
        self.current += size
        self.refs[key] = weakref.ref(st, lambda _ref, key=key: self._freed(key))

    def _freed(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            self.track(t)
        self.peak = max(self.peak, self.current)
        return out


def build(case: Case) -> tuple[torch.nn.Module, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        case.family, max_position_embeddings=4096, **{**FAMILIES[case.family], **(case.shape or {})}
    )
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model = get_peft_model(
        model, LoraConfig(r=case.rank, lora_alpha=2 * case.rank, lora_dropout=0.0, target_modules=TARGETS)
    )
    if case.checkpointing:  # as dtrain.lora.model.enable_activation_checkpointing does it
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, config


def measure(case: Case) -> dict[str, Any]:
    """Planned vs measured peak bytes of one training step of `case`."""
    model, config = build(case)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    x = torch.randint(0, config.vocab_size, (case.batch, case.seq_len))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    start = time.perf_counter()
    with LiveBytes() as live:
        for t in [*model.parameters(), *model.buffers(), x]:
            live.track(t)
        for state in opt.state.values():
            for t in state.values():
                live.track(t)
        static = live.current  # weights, buffers, AdamW moments, the input
        step()
    seconds = time.perf_counter() - start
    shape = lp.shape_from_config(config, case.family)
    planned = lp.memory(
        shape,
        seq_len=case.seq_len,
        batch=case.batch,
        lora_rank=case.rank,
        precision=case.precision,
        checkpointing=case.checkpointing,
        overhead=False,
    )
    # What the step adds on top of what persists: activations, autocast's copies, LoRA gradients.
    planned_step = planned.activations + planned.casts + planned.adapter_grads
    return {
        "case": case.name,
        "planned_bytes": planned.allocated,
        "measured_bytes": live.peak,
        "error": planned.allocated / live.peak - 1,
        "planned_step_bytes": planned_step,
        "measured_step_bytes": live.peak - static,
        "step_error": planned_step / (live.peak - static) - 1,
        "planned": {k: v for k, v in dataclasses.asdict(planned).items()},
        "seconds": seconds,
        "trainable": sum(p.numel() for p in params),
        "planned_trainable": shape.lora_params(case.rank),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = [measure(c) for c in CASES]
    mib = 2**20
    peak = f"{'peak planned':>14} {'measured':>9} {'error':>7}"
    added = f"{'step planned':>14} {'measured':>9} {'error':>7}"
    print(f"{'configuration (MiB)':38} {peak}   {added}")
    for r in rows:
        print(
            f"{r['case']:38} {r['planned_bytes'] / mib:14.2f} {r['measured_bytes'] / mib:9.2f} {r['error']:+7.1%}   "
            f"{r['planned_step_bytes'] / mib:14.2f} {r['measured_step_bytes'] / mib:9.2f} {r['step_error']:+7.1%}"
        )
    worst = max(abs(r["error"]) for r in rows)
    worst_step = max(abs(r["step_error"]) for r in rows)
    print(
        f"Largest error over {len(rows)} configurations: {worst:.1%} on the peak (everything allocated), "
        f"{worst_step:.1%} on what the step adds to the weights and optimizer state (activations, casts, gradients)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "largest_error": worst, "largest_step_error": worst_step, "torch": torch.__version__},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
