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
import logging
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
# The two shapes of the plan-vs-measured table: dtrain's tiny-llama preset (3.5M parameters) and a
# 134M-parameter Llama (12 layers, 768 wide, grouped k/v heads, a 32,000-word vocabulary).
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=258),
    "134m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    family: str
    precision: str  # fp32 or bf16 (QLoRA: bf16, its compute dtype)
    checkpointing: bool
    seq_len: int
    batch: int
    rank: int = 8
    shape: dict | None = None  # config fields over FAMILIES[family] (the tests use smaller ones)
    quant: str = "none"  # or 4bit (QLoRA on bitsandbytes' CPU kernels)
    packed: bool = False  # SFT rows of several documents each (position ids restart), a prompt untrained
    adapter_dtype: str = "fp32"
    optimizer: str = "adamw"
    strategy: str = "ddp"  # with world > 1: ddp or fsdp, over gloo
    world: int = 1
    label: str = ""  # the shape's name in the table

    @property
    def name(self) -> str:
        bits = [self.label or self.family, "QLoRA" if self.quant == "4bit" else "LoRA", self.precision]
        bits.append("ckpt" if self.checkpointing else "no-ckpt")
        bits.append("packed" if self.packed else "rows")
        if self.adapter_dtype != "fp32":
            bits.append(f"adapter {self.adapter_dtype}")
        if self.optimizer != "adamw":
            bits.append(self.optimizer)
        if self.world > 1:
            bits.append(f"{self.strategy} x{self.world}")
        return " ".join(bits) + f" {self.seq_len}x{self.batch}"


CASES = (
    Case(family="llama", precision="fp32", checkpointing=False, seq_len=256, batch=2),
    Case(family="llama", precision="fp32", checkpointing=True, seq_len=512, batch=2),
    Case(family="qwen2", precision="bf16", checkpointing=False, seq_len=256, batch=2),
    Case(family="qwen2", precision="bf16", checkpointing=True, seq_len=512, batch=1),
    Case(family="mistral", precision="bf16", checkpointing=False, seq_len=128, batch=4),
    Case(family="mistral", precision="fp32", checkpointing=True, seq_len=256, batch=2, rank=16),
)


def shape_cases(label: str, seq_len: int, batch: int, qlora: bool = True, distributed: bool = True) -> list[Case]:
    """Every configuration the plan offers, on SHAPES[label]: LoRA (fp32 and bf16) and QLoRA, with
    and without checkpointing, packed and not, bf16 adapters, 8-bit AdamW, DDP and FSDP on two ranks
    (checkpointing on with packed rows, and off with plain rows), QLoRA under DDP and FSDP too."""
    base = dict(family="llama", shape=SHAPES[label], label=label, seq_len=seq_len, batch=batch)
    cases = [
        Case(**base, precision=p, checkpointing=c, packed=k)
        for p in ("fp32", "bf16")
        for c in (False, True)
        for k in (False, True)
    ]
    cases += [
        Case(**base, precision="bf16", checkpointing=True, packed=True, adapter_dtype="bf16"),
        Case(**base, precision="bf16", checkpointing=True, packed=True, optimizer="adamw-8bit"),
    ]
    if qlora:
        cases += [Case(**base, precision="bf16", checkpointing=c, packed=True, quant="4bit") for c in (False, True)]
    if distributed:
        cases += [
            Case(**base, precision="bf16", checkpointing=c, packed=c, world=2, strategy=s)
            for s in ("ddp", "fsdp")
            for c in (True, False)
        ]
    if qlora and distributed:  # the plan's QLoRA (4-bit base, DDP) and its last resort, QLoRA sharded
        cases += [
            Case(**base, precision="bf16", checkpointing=True, packed=True, quant="4bit", world=2, strategy=s)
            for s in ("ddp", "fsdp")
        ]
    return cases


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, over what runs inside it (module docstring)."""

    def __init__(self, recheck: bool = False) -> None:
        super().__init__()
        # FSDP2 frees a gathered weight with UntypedStorage.resize_(0), which no operator sees: with
        # recheck, every storage's size is read again after each operator (slower; sharded runs only).
        self.recheck = recheck
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
        if self.recheck:
            for key, ref in list(self.refs.items()):
                st = ref()
                if st is not None and st.nbytes() != self.sizes[key]:
                    self.current += st.nbytes() - self.sizes[key]
                    self.sizes[key] = st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def build(case: Case) -> tuple[torch.nn.Module, Any]:
    """The model as dtrain.lora.train builds it for `case` (without the CPU-only fusions)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtrain.lora import model as modelmod
    from dtrain.lora import quant as quantmod
    from dtrain.lora.lean import lean_model

    config = AutoConfig.for_model(
        case.family, max_position_embeddings=4096, **{**FAMILIES[case.family], **(case.shape or {})}
    )
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if case.quant == "4bit":  # the preset path of dtrain.lora.model.load_base: written, read back quantized
        model = modelmod._quantized_preset(model, dtype, None, quantmod.nf4_config(dtype), "sdpa")
        model = quantmod.prepare(model)
    model = get_peft_model(
        model, LoraConfig(r=case.rank, lora_alpha=2 * case.rank, lora_dropout=0.0, target_modules=TARGETS)
    )
    if case.adapter_dtype == "bf16":
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    lean_model(model)
    if case.checkpointing:
        modelmod.enable_activation_checkpointing(model)
    model.train()
    return model, config


def batch_of(case: Case, vocab: int) -> torch.Tensor:
    """Plain blocks (B x L), or SFT rows (B x 3 x L: ids, labels, positions) packed with documents of
    64 to 192 tokens whose first third is an untrained prompt, as dtrain.lora.sft lays them out."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (case.batch, case.seq_len), generator=g)
    if not case.packed:
        return ids
    from dtrain.lora.loss import IGNORE

    labels, pos = ids.clone(), torch.zeros_like(ids)
    for r in range(case.batch):
        at = 0
        while at < case.seq_len:
            n = min(int(torch.randint(64, 193, (1,), generator=g)), case.seq_len - at)
            pos[r, at : at + n] = torch.arange(n)
            labels[r, at : at + max(1, n // 3)] = IGNORE
            at += n
    return torch.stack([ids, labels, pos], dim=1)


def make_optimizer(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-3)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """dtrain's loss (dtrain.lora.train.lm_loss and sft.forward_rows: the chunked cross-entropy)."""
    from dtrain.lora import sft
    from dtrain.lora.train import lm_loss

    return sft.forward_rows(model, x)[0] if x.dim() == 3 else lm_loss(model, x)


def planned_memory(case: Case, config: Any) -> lp.Memory:
    shape = lp.shape_from_config(config, case.family)
    return lp.memory(
        shape,
        seq_len=case.seq_len,
        batch=case.batch,
        lora_rank=case.rank,
        precision=case.precision,
        quant=case.quant,
        strategy=case.strategy,
        gpus=case.world,
        checkpointing=case.checkpointing,
        adapter_dtype=case.adapter_dtype,
        optimizer=case.optimizer,
        packed=case.packed,
        overhead=False,
    )


def measure(case: Case) -> dict[str, Any]:
    """Planned vs measured peak bytes of one training step of `case` (on two gloo ranks where
    case.world is 2: rank 0's figures)."""
    if case.world > 1:
        return _measure_ranks(case)
    return _measure(case, None)


def _measure(case: Case, wrap: Any) -> dict[str, Any]:
    from dtrain.lora import quant as quantmod

    model, config = build(case)
    inner = model
    if wrap is not None:
        model = wrap(model)
    params = [p for p in inner.parameters() if p.requires_grad]
    opt = make_optimizer(case, params)
    x = batch_of(case, config.vocab_size)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):
            loss = loss_of(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    start = time.perf_counter()
    with LiveBytes(recheck=case.strategy == "fsdp" and case.world > 1) as live:
        for t in [*inner.parameters(), *inner.buffers(), x]:
            live.track(_local(t))
        for state in opt.state.values():
            for t in state.values():
                live.track(_local(t))
        for t in quantmod.constant_tensors(inner):
            live.track(t)
        static = live.current  # weights, buffers, AdamW moments, the input
        step()
    seconds = time.perf_counter() - start
    planned = planned_memory(case, config)
    shape = lp.shape_from_config(config, case.family)
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
        "trainable": sum(_local(p).numel() for p in params) * case.world if case.strategy == "fsdp" else
        sum(p.numel() for p in params),
        "planned_trainable": shape.lora_params(case.rank),
    }  # fmt: skip


def _local(t: Any) -> Any:
    """A DTensor's shard on this rank (FSDP2's parameters), anything else as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _rank_main(rank: int, case: Case, port: int, out: str) -> None:
    import os

    warnings.filterwarnings("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=case.world)
    try:
        if case.strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from dtrain.lora.sharding import decoder_layers

            def wrap(model: torch.nn.Module) -> torch.nn.Module:
                mesh = init_device_mesh("cpu", (case.world,))
                layers = decoder_layers(model)
                for layer in reversed(layers):  # as dtrain.lora.sharding.shard does
                    fully_shard(layer, mesh=mesh, reshard_after_forward=layer is not layers[-1])
                fully_shard(model, mesh=mesh)
                from dtrain.lora import quant

                quant.place_quant_states(model, torch.device("cpu"))  # as shard does (4-bit layers only)
                return model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            def wrap(model: torch.nn.Module) -> torch.nn.Module:
                frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
                DDP._set_params_and_buffers_to_ignore_for_model(model, frozen + [n for n, _ in model.named_buffers()])
                return DDP(model, forward_sync_buffers=False)

        r = _measure(case, wrap)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(r, f)
    finally:
        torch.distributed.destroy_process_group()


def _measure_ranks(case: Case) -> dict[str, Any]:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.json"
        mp.start_processes(_rank_main, args=(case, port, out), nprocs=case.world, join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--shapes", default="families,tiny,134m", help="comma-separated: families (the six CASES), tiny, 134m"
    )
    p.add_argument("--only", default="", help="run only the configurations whose name contains this")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    cases: list[Case] = []
    for name in args.shapes.split(","):
        if name == "families":
            cases += CASES
        elif name == "tiny":
            cases += shape_cases("tiny", 512, 2)
        elif name == "134m":
            cases += shape_cases("134m", 256, 2)
        else:
            p.error(f"unknown shape {name!r}")
    cases = [c for c in cases if args.only in c.name]
    mib = 2**20
    peak = f"{'peak planned':>14} {'measured':>9} {'error':>7}"
    added = f"{'step planned':>14} {'measured':>9} {'error':>7}"
    print(f"{'configuration (MiB)':56} {peak}   {added}", flush=True)
    rows = []
    for c in cases:
        r = measure(c)
        rows.append(r)
        print(
            f"{r['case']:56} {r['planned_bytes'] / mib:14.2f} {r['measured_bytes'] / mib:9.2f} {r['error']:+7.1%}   "
            f"{r['planned_step_bytes'] / mib:14.2f} {r['measured_step_bytes'] / mib:9.2f} {r['step_error']:+7.1%}",
            flush=True,
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
