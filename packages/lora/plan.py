"""The memory plan of a LoRA run: what one GPU holds, whether it fits, how to run it, and on what.

`plan(...)` is pure arithmetic on a model's shape (`ModelShape`, read from its config.json without
its weights by `read_shape`) and the run's settings; `dtrain plan` prints it, and `dtrain train lora`
can call `plan` to choose its defaults and `refuse_if_unfit` to stop, in one line, a run that cannot
fit, before anything is loaded. Nothing here imports torch; reading a config imports transformers.

What one GPU holds, in bytes (docs/memory-plan.md has the derivation and the measurements):

- Base weights: every parameter (embeddings, the seven projections of each layer, norms, the output
  projection unless tied) at 2 B (bf16/fp16) or 4 B (fp32). QLoRA stores the projections in NF4:
  4 bits a weight plus its block constants, one fp32 absmax per 64 weights (0.5 bit a weight) which
  double quantization stores as 8 bits plus an fp32 constant per 256 blocks, 0.127 bit a weight
  (Dettmers et al., "QLoRA", arXiv:2305.14314, section 3; bitsandbytes' Params4bit, blocksize 64):
  NF4_BYTES_PER_PARAM = (4 + 0.127) / 8. Embeddings, norms and the output projection are loaded in
  the compute dtype, and peft's prepare_model_for_kbit_training (what dtrain.lora.quant.prepare, TRL
  and axolotl call) then casts every non-quantized half-precision parameter to fp32: 4 B each
  (Llama-3.1-8B's embedding and head: 4.2 GB instead of 2.1). While a QLoRA projection runs, its
  weight is dequantized to the compute dtype: the largest (h x f), made for one projection's input
  gradient and freed before the next, so it counts against a layer's backward temporaries (whichever is
  larger), never on top of them or of the loss's logits.
- LoRA adapter: r x (d_in + d_out) weights per adapted projection, in fp32 (peft's default), so the
  weights are their own fp32 master copy: 4 B weight + 4 B gradient + 8 B AdamW moments (exp_avg,
  exp_avg_sq) = 16 B a LoRA weight; under autocast a bf16/fp16 copy of each LoRA weight (2 B) is kept
  for the backward. DDP adds its gradient buckets (4 B a LoRA weight) with more than one process.
- Activations: what autograd keeps from the forward for the backward, per token of the micro-batch
  (b x s tokens), for a Llama-style decoder layer (hidden h, MLP width f, q = heads x head_dim,
  kv = kv_heads x head_dim, LoRA on q, k, v, o, gate, up, down), a = 2 B under bf16/fp16 autocast and
  4 B in fp32 (16-bit steps run dtrain.lora.lean, which keeps less without changing a number):
    * the two RMSNorms: in fp32 each saves its input (4h) and an inverse RMS value (4); in 16-bit
      steps each keeps its 16-bit input (a h) and remakes the fp32 arithmetic in the backward;
    * each LoRA A saves its input; the projections that share an input share it, a x (2h + f): one
      for q/k/v, one for gate/up, down's own, and o's is the attention output (under autocast
      dtrain.lora.lean skips peft's cast of the input to the adapter dtype, which autocast undid);
    * SDPA (flash / memory-efficient) keeps q, k, v after the rotary embedding and its output:
      a x (2q + 2kv), and a 4 B log-sum-exp per head; on a GPU without bf16 (T4, V100) grouped k/v
      heads are repeated to q's width first (the memory-efficient kernel has no GQA), so 4q;
    * SwiGLU keeps gate, up and, in fp32, silu(gate): 3af (fp32), 2af (16-bit: remade in the backward);
    * the LoRA A outputs: a x r per adapted projection (7r).
  So per layer and token, in 16-bit: 2ah + a(2h + f) + a(2q + 2kv) + 2af + 7ar + 4 heads
  (bf16, Llama-3-8B: 8h + 4q + 4kv + 6f ~ 0.17 MB a token).
  The frozen embedding's output needs no gradient: the first layer's norm keeps nothing (-4h).
  The loss: transformers upcasts the logits to fp32, cross-entropy keeps its fp32 log-probabilities
  (4V a token) and the backward starts with two more fp32 tensors of the same size (the gradients of
  the loss and of the log-softmax), all alive at once with every layer's activations: 12V a token.
  With a vocabulary of 128k that is 1.5 MB a token, seven times a layer: often the largest single
  item. The rotary cos/sin tables (2 x a x head_dim x s) are shared by the layers.
  With activation checkpointing (per decoder layer, non-reentrant) each layer keeps only its input
  (a x h a token); the backward recomputes one layer at a time, so the peak is the larger of the
  loss's (all the layer inputs + 4h + 12V) and a layer's recompute (all the layer inputs + one full
  layer, less its first norm's input, which is the layer's input, + its backward temporaries: the
  gradient of the hidden state and two MLP-wide gradients).
- Overhead: the CUDA context lives outside torch's allocator and is taken off the card's capacity
  (dtrain.common.accelerators.CUDA_CONTEXT_GIB); torch's caching allocator rounds and fragments, and
  cuBLAS keeps workspaces: ALLOCATOR_FRACTION of the total plus WORKSPACE_GIB. These are estimates:
  the CPU check (benchmarks/memory_plan.py) measures the rest, not them.

Sharded (FSDP2) runs divide the base weights and the LoRA state by the GPU count and add two layers'
unsharded weights (the one computing and the one prefetched) and the root unit's (embeddings, final
norm, output layer), which FSDP2 keeps gathered from the forward to the end of the backward. A sharded
4-bit base (QLoRA + FSDP2) shards the packed 4-bit values (0.5 B a weight) but not the quantization
constants (0.127 bit a weight, whole on every GPU); its gathered layers are packed too.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from dtrain.common import accelerators
from dtrain.common.errors import UserError

GIB = 2**30
NF4_BYTES_PER_PARAM = (4 + 0.127) / 8
NF4_PACKED_BYTES = 4 / 8  # the part FSDP2 shards; the rest (the constants) stays whole on every GPU
LORA_STATE_BYTES = 4 + 4 + 8  # fp32 weight (its own master copy), gradient, AdamW's two moments
ADAPTER_DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit")
ATTENTIONS = ("sdpa", "flash")  # flash: flash-attention 2's varlen call for packed rows (no dense mask)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' Optimizer8bit min_8bit_size: smaller tensors keep fp32 moments
BNB_BLOCK = 256  # values per fp32 scale in bitsandbytes' blockwise 8-bit moments
CHUNK_TOKENS = 512  # dtrain.lora.loss.CHUNK_TOKENS (checked equal in tests/lora/test_plan.py)
ALLOCATOR_FRACTION = 0.05
WORKSPACE_GIB = 0.25
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Decoders built like Llama (RMSNorm, rotary attention with grouped k/v heads, SwiGLU MLP, these
# projection names): the formula above is theirs.
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
QUANTS = ("auto", "none", "4bit")
STRATEGIES = ("auto", "ddp", "fsdp")
CHECKPOINTING = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shapes that decide memory, from a model's config.json."""

    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def proj_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of a layer."""
        h, f = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q),
            "k_proj": (h, self.kv),
            "v_proj": (h, self.kv),
            "o_proj": (self.q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def layer_proj_params(self) -> int:
        return sum(i * o for i, o in self.proj_shapes().values()) + (self.q + 2 * self.kv if self.qkv_bias else 0)

    def other_params(self) -> int:
        """Embeddings, norms and the output projection: kept in the compute dtype under QLoRA."""
        h = self.hidden
        return self.vocab * h * (1 if self.tied else 2) + self.layers * 2 * h + h

    def params(self) -> int:
        return self.layers * self.layer_proj_params() + self.other_params()

    def lora_params(self, r: int, targets: tuple[str, ...] = LLAMA_TARGETS) -> int:
        shapes = self.proj_shapes()
        return self.layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes one GPU holds at the step's peak (the start of the backward, or a layer's recompute)."""

    weights: float
    adapter: float  # LoRA weights (fp32)
    adapter_grads: float
    optimizer: float  # AdamW moments
    casts: float  # autocast's low-precision copies of the LoRA weights
    activations: float  # the peak of what the step keeps, with the checkpointing this plan uses
    activations_no_ckpt: float
    activations_ckpt: float
    overhead: float  # allocator rounding and fragmentation, cuBLAS workspaces

    @property
    def allocated(self) -> float:
        """What torch allocates at the peak: everything but the overhead (what the CPU check measures)."""
        return self.weights + self.adapter + self.adapter_grads + self.optimizer + self.casts + self.activations

    @property
    def total(self) -> float:
        return self.allocated + self.overhead


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelShape
    accelerator: str  # GCP accelerator type, or "cpu" for a plan without a card
    card_label: str
    usable: float  # bytes torch can allocate on one card (inf for "cpu")
    gpus: int  # GPUs in all (per node x nodes)
    precision: str  # bf16, fp16 or fp32
    quant: str  # none or 4bit (what the plan uses)
    strategy: str  # ddp or fsdp
    checkpointing: bool
    seq_len: int
    batch: int
    lora_rank: int
    memory: Memory
    notes: tuple[str, ...] = ()
    adapter_dtype: str = "fp32"
    optimizer: str = "adamw"

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable

    @property
    def method(self) -> str:
        """How the run goes: DDP, QLoRA (DDP on 4-bit base weights), sharded (FSDP2), or both."""
        if self.strategy == "fsdp":
            return "QLoRA sharded (4-bit base, FSDP2)" if self.quant == "4bit" else "sharded (FSDP2)"
        return "QLoRA (4-bit base, DDP)" if self.quant == "4bit" else "DDP"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The smallest dtrain cluster that runs a plan: accelerator x per_node on `nodes` machines."""

    accelerator: str
    per_node: int
    nodes: int
    machine_type: str
    usd_per_hour: float | None
    plan: Plan
    spot_only: bool = False


# ---------------------------------------------------------------------------------------------
# Reading a model's shape


def shape_from_config(config: Any, name: str) -> ModelShape:
    """A ModelShape from a transformers config (or anything with its attribute names)."""
    model_type = getattr(config, "model_type", "") or ""
    if model_type not in LLAMA_STYLE:
        raise UserError(
            f"{name}: the memory plan knows Llama-style decoders ({', '.join(LLAMA_STYLE)}), not "
            f"model_type {model_type or '(none)'!r}"
        )
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return ModelShape(
        name=name,
        model_type=model_type,
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        vocab=int(config.vocab_size),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")),
    )


def read_shape(model: str) -> ModelShape:
    """The shape of `model`: a dtrain preset, a local directory with config.json, or a Hugging Face id
    (only its config.json is fetched, through transformers, with HF_TOKEN for gated models)."""
    from dtrain.common import env as envmod

    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise UserError(f"{model}: a model directory needs its config.json")
    elif "/" not in model and not Path(model).exists():
        from dtrain.lora.model import PRESETS  # imports torch: only for names that may be presets

        if model in PRESETS:
            from transformers import AutoConfig

            p = PRESETS[model]
            return shape_from_config(AutoConfig.for_model(p.family, **p.kwargs), model)
    import os

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model, token=os.environ.get("HF_TOKEN") or None, local_files_only=envmod.offline()
        )
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"cannot read the config of {model!r}: {first[:200].rstrip('.')}. Give a local directory with "
            "config.json, a preset, or a hub id on a machine with internet (HF_TOKEN for gated models)"
        ) from None
    return shape_from_config(config, model)


# ---------------------------------------------------------------------------------------------
# The arithmetic


def activation_bytes(
    m: ModelShape,
    *,
    seq_len: int,
    batch: int,
    lora_rank: int,
    precision: str,
    checkpointing: bool,
    repeat_kv: bool = False,
    targets: tuple[str, ...] = LLAMA_TARGETS,
    adapter_dtype: str = "fp32",
    loss_chunk: int = CHUNK_TOKENS,
    packed: bool = False,
    attention: str = "sdpa",
    dequantized: float = 0.0,
) -> float:
    """The activations' peak in bytes for one micro-batch (the module docstring's formula). `dequantized`:
    QLoRA's one projection dequantized at a time: made for one projection's input gradient and freed before
    the next gradient is made, so it counts against a layer's backward temporaries, not on top of them
    (measured on the CPU, tiny-llama, 128 to 512 tokens, checkpointing on: with it added on top, QLoRA's plan
    was over the measured peak by LoRA's margin plus the whole dequantized weight), and never during the
    loss."""
    a = 4 if precision == "fp32" else 2
    autocast = precision != "fp32"
    # dtrain.lora.lean, in 16-bit steps: the norms keep their 16-bit inputs (not fp32 copies), SwiGLU
    # keeps gate and up (silu(gate) is remade in the backward), and peft's LoRA input casts are skipped
    # under autocast, so the projections that share an input share its saved copy.
    lean = autocast
    h, f, q, kv, r = m.hidden, m.intermediate, m.q, m.kv, lora_rank
    kv_saved = q if repeat_kv and kv < q else kv
    shapes = m.proj_shapes()
    adapted = [t for t in targets if t in shapes]
    # shared inputs: one for q/k/v, one for gate/up, o's is the attention output, down's its own
    groups = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    lora_inputs = a * (h * len({groups[t] for t in adapted if t in groups}) + (f if "down_proj" in adapted else 0))
    norms = 2 * a * h if lean else 2 * 4 * h + 8  # fp32 inputs and inverse RMS values, unless remade
    swiglu = (2 if lean else 3) * a * f
    layer = norms + lora_inputs + a * (2 * q + 2 * kv_saved) + swiglu + a * r * len(adapted) + 4 * m.heads
    tokens = batch * seq_len
    # The chunked loss (dtrain.lora.loss): it keeps the final hidden states (a h), each token's fp32
    # log-sum-exp and its shifted label (4 + 8); the backward adds the hidden states' gradient (a h)
    # and one chunk's logits at a time: fp32 (4 V), and under autocast the compute-dtype logits they
    # are upcast from, then the gradient cast back (2 V), never both at once.
    chunk = min(tokens, max(1, loss_chunk))
    logits = chunk * m.vocab * (4 + (2 if autocast else 0))
    loss = tokens * (2 * a * h + 12 + 8) + logits
    # a layer's backward temporaries: the hidden state's gradient and two MLP-wide gradients
    temps = a * h + 2 * a * f
    rotary = 2 * a * m.head_dim * seq_len
    # Packed rows under sdpa: transformers' per-document mask (B x L x L booleans, 1 B each, an input
    # of every layer), which SDPA turns into an additive mask in the compute dtype and keeps for its
    # backward, a layer at a time; flash-attention's varlen call takes the documents' offsets instead.
    dense = packed and attention == "sdpa"
    mask = batch * seq_len * seq_len if dense else 0
    layer_mask = a * mask
    if not checkpointing:
        # The first layer's norm keeps nothing (its input, the frozen embedding's output, needs no
        # gradient); the final norm keeps what a layer's norm keeps: -1 + 1.
        # The peak: every layer's activations, with the loss's backward (one chunk's logits) or, after
        # it, the last layer's backward temporaries, whichever is larger.
        kept = tokens * m.layers * layer + m.layers * layer_mask + mask + loss - logits + rotary
        return kept + max(logits, tokens * temps, dequantized)
    inputs = tokens * m.layers * a * h
    at_loss = inputs + tokens * (a * h if lean else 4 * h) + loss  # + the final norm's input
    shared = a * h if lean else 0  # the first norm keeps the layer's input, which the checkpoint keeps
    at_recompute = inputs + tokens * (layer - shared) + max(tokens * temps, dequantized) + layer_mask
    return max(at_loss, at_recompute) + mask + rotary


def memory(
    m: ModelShape,
    *,
    seq_len: int,
    batch: int,
    lora_rank: int,
    precision: str,
    quant: str = "none",
    strategy: str = "ddp",
    gpus: int = 1,
    checkpointing: bool = False,
    repeat_kv: bool = False,
    targets: tuple[str, ...] = LLAMA_TARGETS,
    overhead: bool = True,
    adapter_dtype: str = "fp32",
    optimizer: str = "adamw",
    loss_chunk: int = CHUNK_TOKENS,
    packed: bool = False,
    attention: str = "sdpa",
) -> Memory:
    """What one of `gpus` GPUs holds (bytes). `overhead=False` leaves out the allocator's share (for the
    CPU check, whose allocator has none)."""
    if attention not in ATTENTIONS:
        raise UserError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if adapter_dtype not in ADAPTER_DTYPES or optimizer not in OPTIMIZERS:
        raise UserError(
            f"adapter dtype must be one of {', '.join(ADAPTER_DTYPES)} and optimizer one of {', '.join(OPTIMIZERS)}"
        )
    wb = 4 if precision == "fp32" else 2
    proj = m.layers * m.layer_proj_params()
    # QLoRA: embeddings, norms and head stay in the compute dtype (dtrain.lora.quant.prepare casts nothing).
    other_b = wb
    weights = (proj * NF4_BYTES_PER_PARAM if quant == "4bit" else proj * wb) + m.other_params() * other_b
    n_lora = m.lora_params(lora_rank, targets)
    shard = gpus if strategy == "fsdp" else 1
    ab = 2 if adapter_dtype == "bf16" else 4
    casts = 2 * n_lora if precision != "fp32" and adapter_dtype == "fp32" else 0
    # QLoRA: one projection dequantized at a time, while a layer computes (activation_bytes places it)
    dequantized = wb * max(i * o for i, o in m.proj_shapes().values()) if quant == "4bit" else 0.0
    if strategy == "fsdp" and gpus > 1:
        # the rest sharded; two layers' projections unsharded (computing, prefetched) and the root's
        # embeddings, norm and head gathered for the whole step
        proj_b = NF4_PACKED_BYTES if quant == "4bit" else wb
        whole = proj * (NF4_BYTES_PER_PARAM - NF4_PACKED_BYTES) if quant == "4bit" else 0.0
        other = m.other_params() * other_b
        weights = (proj * proj_b + other) / shard + whole + 2 * m.layer_proj_params() * proj_b + other
    adapter, grads = ab * n_lora / shard, ab * n_lora / shard
    opt = optimizer_bytes(m, lora_rank, targets, adapter_dtype, optimizer) / shard
    if strategy == "ddp" and gpus > 1:
        grads += ab * n_lora  # DDP's gradient buckets
    kw = dict(
        seq_len=seq_len,
        batch=batch,
        lora_rank=lora_rank,
        precision=precision,
        repeat_kv=repeat_kv,
        adapter_dtype=adapter_dtype,
        loss_chunk=loss_chunk,
        packed=packed,
        attention=attention,
        dequantized=dequantized,
    )
    act_off = activation_bytes(m, checkpointing=False, targets=targets, **kw)
    act_on = activation_bytes(m, checkpointing=True, targets=targets, **kw)
    act = act_on if checkpointing else act_off
    allocated = weights + adapter + grads + opt + casts + act
    over = ALLOCATOR_FRACTION * allocated + WORKSPACE_GIB * GIB if overhead else 0.0
    return Memory(
        weights=weights,
        adapter=adapter,
        adapter_grads=grads,
        optimizer=opt,
        casts=casts,
        activations=act,
        activations_no_ckpt=act_off,
        activations_ckpt=act_on,
        overhead=over,
    )


def optimizer_bytes(
    m: ModelShape, lora_rank: int, targets: tuple[str, ...], adapter_dtype: str, optimizer: str
) -> float:
    """AdamW's two moments over the LoRA weights: in the weights' dtype (torch), or 8 bits each with an
    fp32 scale a 256-value block for every tensor of at least BNB_MIN_8BIT_SIZE values (bitsandbytes'
    AdamW8bit; smaller tensors keep two fp32 moments), plus its two 256-entry fp32 code books a tensor."""
    n = m.lora_params(lora_rank, targets)
    if optimizer == "adamw":
        return 2 * (2 if adapter_dtype == "bf16" else 4) * n
    total = 0.0
    shapes = m.proj_shapes()
    for t in targets:
        if t not in shapes:
            continue
        for size in (lora_rank * shapes[t][0], lora_rank * shapes[t][1]):  # A (r x in), B (out x r)
            if size >= BNB_MIN_8BIT_SIZE:
                total += 2 * size + 2 * 4 * math.ceil(size / BNB_BLOCK) + 2 * 256 * 4
            else:
                total += 8 * size
    return total * m.layers


def _precision_for(card: accelerators.Card | None, precision: str) -> str:
    if precision != "auto":
        return precision
    return card.compute_precision if card else "fp32"


def plan(
    m: ModelShape,
    *,
    accelerator: str,
    gpus: int = 1,
    seq_len: int,
    batch: int,
    lora_rank: int = 8,
    precision: str = "auto",
    quant: str = "auto",
    strategy: str = "auto",
    checkpointing: str = "auto",
    targets: tuple[str, ...] = LLAMA_TARGETS,
    usable_gib: float | None = None,
    adapter_dtype: str = "fp32",
    optimizer: str = "adamw",
    packed: bool = False,
    attention: str = "sdpa",
) -> Plan:
    """The plan for `gpus` x `accelerator` (a GCP accelerator type, a GPU name as torch or nvidia-smi
    reports it, or "cpu" for no card; `usable_gib` overrides the card's figure, e.g. with what
    torch.cuda.mem_get_info says on the machine itself): the first
    that fits of DDP, DDP with activation checkpointing, QLoRA, QLoRA with checkpointing, and (with
    more than one GPU) sharded, then sharded 4-bit, each without then with checkpointing; "auto" settings
    choose, others are kept as asked
    (quant "none": never 4-bit, "4bit": always). When nothing fits, the try that needs least."""
    for value, allowed, what in (
        (precision, PRECISIONS, "precision"),
        (quant, QUANTS, "quant"),
        (strategy, STRATEGIES, "strategy"),
        (checkpointing, CHECKPOINTING, "activation checkpointing"),
    ):
        if value not in allowed:
            raise UserError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
    for value, what in ((seq_len, "--seq-len"), (batch, "--batch"), (lora_rank, "--lora-rank"), (gpus, "--gpus")):
        if value < 1:
            raise UserError(f"{what} must be at least 1, got {value}")
    card = None if accelerator == "cpu" else _card(accelerator)
    prec = _precision_for(card, precision)
    notes: list[str] = []
    if card is not None and prec == "bf16" and not card.bf16:
        raise UserError(f"{card.label} has no bf16: use --precision fp16 (or auto)")
    if quant == "4bit" and card is None:
        raise UserError("--quant 4bit (QLoRA, bitsandbytes) needs a CUDA GPU: plan for an --accelerator")
    usable = (usable_gib if usable_gib is not None else card.usable_gib if card else math.inf) * GIB
    repeat_kv = card is not None and not card.bf16  # no flash attention before sm80: GQA heads repeated

    def candidate(strat: str, q: str, ckpt: bool) -> Plan:
        mem = memory(
            m,
            seq_len=seq_len,
            batch=batch,
            lora_rank=lora_rank,
            precision=prec,
            quant=q,
            strategy=strat,
            gpus=gpus,
            checkpointing=ckpt,
            repeat_kv=repeat_kv,
            targets=targets,
            overhead=card is not None,
            adapter_dtype=adapter_dtype,
            optimizer=optimizer,
            packed=packed,
            attention=attention,
        )
        return Plan(
            model=m,
            accelerator=accelerator,
            card_label=card.label if card else "CPU",
            usable=usable,
            gpus=gpus,
            precision=prec,
            quant=q,
            strategy=strat,
            checkpointing=ckpt,
            seq_len=seq_len,
            batch=batch,
            lora_rank=lora_rank,
            memory=mem,
            notes=tuple(notes),
            adapter_dtype=adapter_dtype,
            optimizer=optimizer,
        )

    ckpts = {"on": (True,), "off": (False,), "auto": (False, True)}[checkpointing]
    order: list[tuple[str, str]] = []
    if strategy in ("auto", "ddp"):
        if quant in ("auto", "none"):
            order.append(("ddp", "none"))
        if quant in ("auto", "4bit") and card is not None:
            order.append(("ddp", "4bit"))
    if strategy == "fsdp" or (strategy == "auto" and gpus > 1):
        if quant in ("auto", "none"):
            order.append(("fsdp", "none"))
        if quant in ("auto", "4bit") and card is not None:  # the last resort: 4-bit and sharded
            order.append(("fsdp", "4bit"))
    tried = [candidate(s, q, c) for s, q in order for c in ckpts]
    for p in tried:
        if p.fits:
            return p
    # Nothing fits: report the most frugal try.
    return min(tried, key=lambda p: p.memory.total)


def _card(accelerator: str) -> accelerators.Card:
    from dtrain.control.gcp import rules

    refused = rules.refused_accelerator(accelerator)
    if refused:  # the card exists, but dtrain's GPU image cannot run on it
        raise UserError(f"accelerator {accelerator} is refused: {refused}")
    try:
        return accelerators.card(accelerator)
    except KeyError:
        by_name = accelerators.by_name(accelerator)
        if by_name is not None:
            return by_name
        known = ", ".join(rules.accelerators())
        raise UserError(f"unknown accelerator {accelerator!r}: use one of {known}") from None


# ---------------------------------------------------------------------------------------------
# Clusters


def _price(machine: str, accelerator: str, per_node: int, nodes: int) -> float | None:
    from dtrain.control.gcp.prices import node_price

    p = node_price(machine, accelerator, per_node, 100, spot=False)
    return p.hourly * nodes if p.known else None


def smallest_cluster(m: ModelShape, *, max_nodes: int | None = None, **settings: Any) -> Cluster | None:
    """The cheapest on-demand dtrain cluster (rules.json's accelerators, counts and default machine
    types, prices.py's list prices) whose plan fits: one node if any fits, else the fewest nodes;
    Spot-only machine types last. None when nothing fits."""
    from dtrain.control.gcp import rules

    r = rules.rules()
    if max_nodes is None:
        max_nodes = r["worker_count"]["max"] + 1
    found: list[Cluster] = []
    for name, a in r["accelerators"].items():
        if settings.get("precision") == "bf16" and not _card(name).bf16:
            continue  # it cannot run what was asked (plan() refuses it); the cards that can still may
        best: Cluster | None = None
        for nodes in _node_counts(max_nodes):
            for per_node in a["allowed_counts"]:
                p = plan(m, accelerator=name, gpus=per_node * nodes, **settings)
                if not p.fits:
                    continue
                machine = a["default_machine"][str(per_node)]
                c = Cluster(
                    accelerator=name,
                    per_node=per_node,
                    nodes=nodes,
                    machine_type=machine,
                    usd_per_hour=_price(machine, name, per_node, nodes),
                    plan=p,
                    spot_only=machine in a.get("spot_only", []),
                )
                if best is None or _cost(c) < _cost(best):
                    best = c
            if best is not None:
                break
        if best is not None:
            found.append(best)
    return min(found, key=_cost) if found else None


def _node_counts(max_nodes: int) -> list[int]:
    counts, n = [], 1
    while n < max_nodes:
        counts.append(n)
        n *= 2
    return [*counts, max_nodes]


def _cost(c: Cluster) -> tuple[bool, float, int]:
    # A Spot-only machine type (a3-highgpu-1g to -4g) only when no on-demand one fits.
    return (c.spot_only, c.usd_per_hour if c.usd_per_hour is not None else math.inf, c.per_node * c.nodes)


def best_effort(m: ModelShape, **settings: Any) -> Plan:
    """The plan that needs the least memory per GPU on the largest card dtrain can rent, sharded over
    as many of them as a cluster can hold: what the refusal quotes."""
    from dtrain.control.gcp import rules

    r = rules.rules()
    # the most memory; between equals, the faster card
    name = max(
        r["accelerators"], key=lambda n: (accelerators.card(n).usable_gib, accelerators.card(n).peak("bf16") or 0)
    )
    a = r["accelerators"][name]
    gpus = max(a["allowed_counts"]) * (r["worker_count"]["max"] + 1)
    frugal = dict(settings, checkpointing="on")
    shard = plan(m, accelerator=name, gpus=gpus, **{**frugal, "strategy": "fsdp", "quant": "none"})
    qlora = plan(m, accelerator=name, gpus=1, **{**frugal, "strategy": "ddp", "quant": "4bit"})
    both = plan(m, accelerator=name, gpus=gpus, **{**frugal, "strategy": "fsdp", "quant": "4bit"})
    return min((shard, qlora, both), key=lambda p: p.memory.total)


def refuse_if_unfit(p: Plan) -> None:
    """Raise the one-line UserError for a plan that does not fit its card (nothing when it does)."""
    if p.fits:
        return
    need, have = p.memory.total / GIB, p.usable / GIB
    raise UserError(
        f"{p.model.name} does not fit {p.gpus} x {p.card_label}: {need:.1f} GiB per GPU ({p.method}, "
        f"checkpointing {'on' if p.checkpointing else 'off'}, seq {p.seq_len} x batch {p.batch}) against "
        f"{have:.1f} GiB usable; run `dtrain plan` for a cluster that fits, or lower --seq-len/--batch"
    )


def refuse_unplaceable(m: ModelShape, **settings: Any) -> None:
    """The one line for a run no dtrain cluster can hold: the largest card and what it would need."""
    best = best_effort(m, **settings)
    raise UserError(
        f"{m.name} fits no cluster dtrain can make: even on {best.gpus} x {best.card_label} "
        f"({best.method}, checkpointing on) it needs {best.memory.total / GIB:.1f} GiB per GPU, and the card "
        f"has {best.usable / GIB:.1f} GiB usable (activations {best.memory.activations / GIB:.1f} GiB for "
        f"seq {best.seq_len} x batch {best.batch}): lower --seq-len or --batch"
    )
