"""Packed attention on the CPU: today's dense-mask SDPA against SDPA per document and flex attention.

    python benchmarks/packed_attention.py [--rounds 5] [--lengths 512,2048,4096] [--step-rows 2x2048] [--threads N]

Part 1, attention alone. One packed row of L tokens holds documents of long-tailed lengths
(log-normal, median 256 tokens, 16 to L; seeded), their position ids restarting at 0. For two head
shapes, tiny-llama's (4 query and 4 key/value heads of 64) and a ~134M model's (SmolLM-135M: 9
query, 3 key/value heads of 64), one forward and backward of the attention (q, k, v requiring
grad) is timed for:
- dense: what `--attention sdpa` runs, transformers' sdpa_attention_forward with the B x 1 x L x L
  block-diagonal boolean mask transformers builds (built once, outside the timing, as transformers
  builds it once a forward for all layers; its bytes are counted in the peak);
- per-doc: dtrain.lora.attention.packed_sdpa_attention (`--attention sdpa_packed`), causal SDPA on
  each document;
- flex: torch.nn.attention.flex_attention with a document-causal block mask, eager and under
  torch.compile (its first call, compilation included, reported apart). Where this torch refuses
  it (torch 2.13 has no flex backward on the CPU), the refusal is printed instead.
The variants run in turn, round after round (A B C A B C: the machine's speed drifts), and the
table gives each one's median ms and its ratio to dense, paired round by round, then the median
ratio. Peak memory is the largest sum of live tensor storages over one forward and backward,
counted by benchmarks/memory_plan.py's LiveBytes (inputs and their gradients included).

Part 2, a training step. The tiny-llama preset with LoRA r8 on its seven projections (dtrain's
fused CPU linears, as `dtrain lora` runs it), built twice from one seed, with attn_implementation
"sdpa" and "sdpa_packed"; rows of chat-like documents packed as dtrain.lora.sft packs them; one
step is dtrain.lora.sft.forward_rows, backward and AdamW. Paired rounds again, and the peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_plan import LiveBytes  # noqa: E402

from dtrain.lora import attention  # noqa: E402

SHAPES = {"tiny-llama": (4, 4, 64), "134M (SmolLM-135M)": (9, 3, 64)}  # query heads, key/value heads, head dim
MEDIAN_DOC, SIGMA_DOC, MIN_DOC = 256, 1.0, 16


def doc_lengths(total: int, gen: torch.Generator) -> list[int]:
    """Long-tailed document lengths filling `total` tokens (the last one cut to fit, as a full row)."""
    out: list[int] = []
    while sum(out) < total:
        n = int(math.exp(math.log(MEDIAN_DOC) + SIGMA_DOC * float(torch.randn((), generator=gen))))
        out.append(max(MIN_DOC, min(n, total - sum(out))))
    return out


class _Heads(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def attention_cases(heads: int, kv_heads: int, dim: int, lens: list[int]) -> dict[str, Callable[[Any], Any]]:
    """name -> fn(q, k, v) returning the attention output, for one packed row of documents `lens`."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = sum(lens)
    module = _Heads(heads, kv_heads)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    dense_mask = (causal & (doc[:, None] == doc[None, :]))[None, None]  # transformers' sdpa_mask, packed

    def document_causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (doc[qi] == doc[ki]) & (qi >= ki)

    block_mask = create_block_mask(document_causal, 1, None, length, length, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = heads != kv_heads
    return {
        "dense": lambda q, k, v: sdpa_attention_forward(module, q, k, v, dense_mask, scaling=dim**-0.5)[0],
        "per-doc": lambda q, k, v: attention.packed_sdpa_attention(module, q, k, v, None, position_ids=pos)[0],
        "flex": lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa),
        "flex compiled": lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa),
    }


def run_attention(fn: Callable[..., Any], heads: int, kv_heads: int, dim: int, length: int) -> tuple[float, int]:
    """(seconds, peak bytes) of one forward and backward of `fn` on fresh q, k, v."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, length, dim, generator=g).requires_grad_()
    k, v = (torch.randn(1, kv_heads, length, dim, generator=g).requires_grad_() for _ in range(2))
    t = time.perf_counter()
    fn(q, k, v).float().pow(2).mean().backward()
    return time.perf_counter() - t, 0


def peak_attention(fn: Callable[..., Any], heads: int, kv_heads: int, dim: int, length: int) -> int:
    with LiveBytes() as live:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, heads, length, dim, generator=g).requires_grad_()
        k, v = (torch.randn(1, kv_heads, length, dim, generator=g).requires_grad_() for _ in range(2))
        for t in (q, k, v):
            live.track(t)
        fn(q, k, v).float().pow(2).mean().backward()
    return live.peak


def paired(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case's seconds per round, the cases run in turn within a round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(fn())
    return times


def attention_table(lengths: list[int], rounds: int) -> None:
    print("Part 1: attention alone, one packed row, forward + backward (fp32, CPU)")
    print(f"{'shape':<20} {'L':>5} {'docs':>4} {'variant':<14} {'median ms':>10} {'x dense':>8} {'peak MiB':>9}")
    for label, shape in SHAPES.items():
        for length in lengths:
            lens = doc_lengths(length, torch.Generator().manual_seed(length))
            for line in attention_rows(shape, lens, rounds):
                print(f"{label:<20} {length:>5} {len(lens):>4} {line}")
            if length == lengths[0]:
                print(f"{'':<20} {'':>5} {'':>4} documents: {lens}")


def attention_rows(shape: tuple[int, int, int], lens: list[int], rounds: int) -> list[str]:
    """The table's lines for one head shape and one row of documents `lens`: every variant, paired."""
    heads, kv_heads, dim = shape
    length = sum(lens)
    fns = attention_cases(heads, kv_heads, dim, lens)
    usable, notes = {}, {}
    for name, fn in fns.items():
        try:
            t0 = time.perf_counter()
            run_attention(fn, heads, kv_heads, dim, length)  # warm-up (compilation for "flex compiled")
            first = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a refusal is a result here, printed
            notes[name] = f"unusable: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
            continue
        if name == "flex compiled":
            notes[name] = f"first call (compiling) {first:.1f} s"
        usable[name] = fn

    def timer(fn: Callable[..., Any]) -> Callable[[], float]:
        return lambda: run_attention(fn, heads, kv_heads, dim, length)[0]

    times = paired({name: timer(fn) for name, fn in usable.items()}, rounds)
    base = times.get("dense")
    lines = []
    for name in fns:
        if name not in usable:
            lines.append(f"{name:<14} {notes[name]}")
            continue
        med = statistics.median(times[name]) * 1e3
        ratio = statistics.median(a / b for a, b in zip(times[name], base, strict=True)) if base else math.nan
        peak = peak_attention(usable[name], heads, kv_heads, dim, length) / 2**20
        extra = f"  {notes[name]}" if name in notes else ""
        lines.append(f"{name:<14} {med:>10.1f} {ratio:>8.2f} {peak:>9.1f}{extra}")
    return lines


def make_step(impl: str, rows: torch.Tensor) -> tuple[Callable[[], float], Callable[[], None]]:
    from dtrain.lora.fused import fuse_lora_linears
    from dtrain.lora.model import apply_lora, load_base
    from dtrain.lora.sft import forward_rows

    attention.register()
    model, _ = load_base("tiny-llama", torch.float32, 0, attention=impl)
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    fuse_lora_linears(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        total, count = forward_rows(model, rows)
        (total / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed() -> float:
        t = time.perf_counter()
        step()
        return time.perf_counter() - t

    return timed, step


def step_table(rows_spec: str, rounds: int) -> None:
    from dtrain.lora.sft import Example, pack_rows

    n_rows, seq = (int(x) for x in rows_spec.split("x"))
    g = torch.Generator().manual_seed(0)
    examples = []
    while sum(len(e.ids) for e in examples) < 0.97 * n_rows * seq:
        n = doc_lengths(seq, g)[0]
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        examples.append(Example(ids=ids, labels=ids[1:] + [-100], where=f"doc {len(examples)}"))
    rows = pack_rows(examples, seq, 0, packing=True)[:n_rows]
    docs = [int((r[2] == 0).sum()) for r in rows]
    print(f"\nPart 2: tiny-llama LoRA r8 training step, {n_rows} packed rows of {seq} ({docs} documents)")
    steps = {impl: make_step(impl, rows) for impl in ("sdpa", attention.PACKED_SDPA)}
    for _, step in steps.values():
        step()  # warm-up, AdamW's moments made
    times = paired({impl: timed for impl, (timed, _) in steps.items()}, rounds)
    for impl, (_, step) in steps.items():
        with LiveBytes() as live:
            step()
        med = statistics.median(times[impl]) * 1e3
        ratio = statistics.median(a / b for a, b in zip(times[impl], times["sdpa"], strict=True))
        print(f"  {impl:<12} median {med:8.1f} ms/step  x sdpa {ratio:.2f}  step peak {live.peak / 2**20:8.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--step-rows", default="2x2048", help="rows x tokens for part 2 ('' skips it)")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    attention_table([int(x) for x in args.lengths.split(",")], args.rounds)
    if args.step_rows:
        step_table(args.step_rows, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
