"""Fused forward/backward passes for the LoRA training step, used where they are exact.

Stock transformers + peft spend a CPU step's non-matmul time in many small full-size passes, each
a fresh allocation. Here, without changing any parameter, name or the saved adapter:

- LoRA linear (peft's `base(x) + lora_B(lora_A(dropout(x))) * scaling`): the low-rank term is
  folded into the frozen weight for the step, W' = W + s B A (a 256 x 8 x 256 product), and A's r
  rows are appended, so ONE GEMM `x @ [W'; A]^T` gives the layer's output and `u = x A^T`; the
  input gradient is one GEMM `gy @ W'`. The rank-r products of the backward keep the long token
  dimension as the reduction or the wide side (`(B^T gy^T)` and `(u^T gy)^T`). No separate scale,
  add or accumulate passes remain.
- RMSNorm (Llama, Qwen2, Mistral): the inverse RMS from one `vector_norm` reduction, the backward
  in closed form (3 full passes instead of autograd's ~7).
- Rotary embedding: `q cos + rotate_half(q) sin` written as one product and two half-width
  `addcmul_`s, forward and backward, instead of neg, cat, two products and a sum.
- On CPU, the linear's matrix products (the full-size ones and the rank-r ones) go through oneDNN's
  fp32 linear rather than torch.mm's MKL: 8-20% faster on the full-size shapes on the AMD EPYC
  this was measured on, more on most rank-r ones (benchmarks/cpu_matmul.py); where this torch has
  no oneDNN, torch.mm.

The attention itself stays transformers' own attention function (SDPA), with its masking, GQA and
sliding-window handling, except where grouped key/value heads would send SDPA to its math backend
(on a T4, or in fp32 on a GPU): there the key/value heads are repeated first, so the memory-efficient
kernel runs (`grouped_heads_fused`). History on this machine (2 threads, tiny-llama, seq 256, batch 8): the
first fused linear saved ~4% a step; A's rows in the base GEMM took the rank-r products from about
63 to 31 ms; folding B into W' and the norm and rotary passes took a further ~8%, and oneDNN
another ~6% (docs/decisions.md, "CPU throughput"). Each is tested equal to the stock path's loss and gradients.

Used only where exact: LoRA on an nn.Linear with one active, unmerged adapter, no dropout or DoRA;
the linear and the norm in fp32 without autocast (the norm's stock path rounds through the input
dtype); the linear on the CPU only; anything else runs the stock forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _onednn_linear_available() -> bool:
    try:
        x = torch.ones(2, 3)
        return bool(torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 3), None, "none", [], "").eq(3).all())
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = torch.backends.mkldnn.is_available() and _onednn_linear_available()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for 2-D fp32 CPU tensors through oneDNN where this torch has it, else torch.mm (MKL).

    On this project's AMD EPYC test machine (2 threads), oneDNN ran the step's full-size products at
    189-213 GFLOP/s against MKL's 158-194 (benchmarks/cpu_matmul.py), with fp32 rounding (max
    relative error 6e-7 against float64)."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")  # w may be strided
    return x @ w.t()


class LoraLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        n = weight.shape[0]
        wa = torch.cat([weight, a])
        wa[:n].addmm_(b, a, alpha=scaling)  # [W + s B A; A]: the step's effective weight, and A
        out = linear(x2, wa)  # [y | u]: the layer's output and x A^T from one GEMM
        y, u = out[:, :n], out[:, n:].contiguous()
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x2, u, wa, b)
        ctx.scaling, ctx.in_shape = scaling, x.shape
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, u, wa, b = ctx.saved_tensors
        n = b.shape[0]
        gy2 = gy.reshape(-1, gy.shape[-1])
        gut = linear(b.t(), gy2).mul_(ctx.scaling)  # r x tokens: (gy B)^T, scaled
        ga = linear(gut, x2.t())  # gut @ x2
        gb = linear(u.t(), gy2.t()).t().mul_(ctx.scaling)  # (u^T gy)^T
        gx = linear(gy2, wa[:n].t()).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        return gx, None, None, ga, gb, None


class RMSNormFn(torch.autograd.Function):
    """y = w * x / rms(x) over the last dimension, for a frozen w."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.shape[-1]
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(h).add_(eps).rsqrt_()
        y = x * rstd
        y.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        gw = g * weight  # dL/d(x / rms)
        # d/dx of x * rstd: rstd * gw - x * rstd^3 * <gw, x> / h
        c = torch.linalg.vecdot(gw, x, dim=-1).unsqueeze_(-1).mul_(rstd.pow(3)).div_(-x.shape[-1])
        return gw.mul_(rstd).addcmul_(x, c), None, None


class RopeFn(torch.autograd.Function):
    """q * cos + rotate_half(q) * sin, rotate_half(q) = [-q2, q1] over the two halves of the head."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = q.shape[-1] // 2
        out = q * cos
        out[..., :h].addcmul_(q[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(q[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        gq = g * cos  # the transpose of the rotation: [g2 s2, -g1 s1] added to g cos
        gq[..., :h].addcmul_(g[..., h:], sin[..., h:])
        gq[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1)
        return gq, None, None


def _exact_fp32(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    return (
        not torch.is_autocast_enabled(x.device.type)
        and x.dtype == torch.float32
        and all(w.dtype == torch.float32 for w in weights)
    )


def _fused_linear_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    usable = (
        name is not None
        and not args
        and not kwargs
        and not self.disable_adapters
        and not self.merged
        and name in self.lora_A
        and not self.use_dora.get(name, False)
        and isinstance(self.lora_dropout[name], torch.nn.Identity)
        and not self.base_layer.weight.requires_grad
        # The fusion exists for oneDNN. On a GPU, [W'; A] would be a second copy of every adapted
        # weight, kept for the backward, to save products that cuBLAS runs as fast unfused.
        and x.device.type == "cpu"
        and _exact_fp32(x, self.lora_A[name].weight, self.lora_B[name].weight, self.base_layer.weight)
    )
    if not usable:
        return self._stock_forward(x, *args, **kwargs)
    base = self.base_layer
    return LoraLinearFn.apply(
        x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, float(self.scaling[name])
    )


def _fused_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if self.weight.requires_grad or not _exact_fp32(x, self.weight):
        return self._stock_forward(x)
    return RMSNormFn.apply(x, self.weight, self.variance_epsilon)


def _fused_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama's / Qwen2's attention block with the rotary pass fused; everything else is theirs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    q, k = RopeFn.apply(q, cos, sin), RopeFn.apply(k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    dropout = 0.0 if not self.training else self.attention_dropout
    if (
        self.config._attn_implementation == "sdpa"
        and attention_mask is None
        and past_key_values is None
        and q.shape[1] != k.shape[1]
        and not grouped_heads_fused(q, k, v, dropout)
    ):
        out, weights = _causal_sdpa_expanded(q, k, v, dropout, self.scaling), None
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._stock_attention)
    if hasattr(self, "sliding_window"):  # Qwen2 passes its window; Llama has none
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attend(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def grouped_heads_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> bool:
    """Whether SDPA runs a fused kernel for causal attention over grouped key/value heads
    (`enable_gqa=True`, no mask: what transformers passes for Qwen2's 14 query / 2 key-value heads).

    On CUDA only the flash and cuDNN kernels take grouped heads; torch 2.13's memory-efficient kernel
    requires equal head counts (`check_batch_size_and_num_heads_dense<false>` in sdp_utils.cpp).
    Flash and cuDNN need fp16/bf16 on sm 8.0 or later, so on a T4 (sm 7.5), or in fp32 on any GPU,
    such a call falls to the math backend: the full T x T score matrix for every head, memory
    quadratic in the sequence length. torch's dispatch checks are asked directly, so a torch that
    widens them is followed. On the CPU, torch's flash kernel takes grouped heads
    (tests/lora/test_fused.py checks the choice)."""
    if q.device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, None, dropout, True, True)
    return can_use_flash_attention(params) or can_use_cudnn_attention(params)


def _causal_sdpa_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scale: float):
    """Causal SDPA with each key/value head repeated for its group of query heads (transformers'
    repeat_kv), so the memory-efficient kernel takes it: memory linear in the sequence length, for
    K and V n_rep times larger. Returns (batch, tokens, heads, head_dim), as the attention functions do."""
    from transformers.integrations.sdpa_attention import repeat_kv

    n_rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), dropout_p=dropout, scale=scale, is_causal=q.shape[2] > 1
    )
    return out.transpose(1, 2).contiguous()


def _patch(module: torch.nn.Module, forward: Any) -> None:
    module._stock_forward = module.forward
    module.forward = types.MethodType(forward, module)


def fuse_lora_linears(model: torch.nn.Module) -> int:
    """Give every peft LoRA Linear over an nn.Linear the fused forward; returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    n = 0
    for m in model.modules():
        if isinstance(m, LoraLinear) and type(m.base_layer) is torch.nn.Linear and not m.fan_in_fan_out:
            _patch(m, _fused_linear_forward)
            n += 1
    return n


def _llama_family() -> tuple[tuple[type, ...], dict[type, Any]]:
    """RMSNorm classes computing w * (x * rsqrt(mean(x^2) + eps)), and attention classes whose forward
    is q/k/v projections, rotary, the attention interface and o_proj, each with its stock attention."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    norms = (llama.LlamaRMSNorm, qwen2.Qwen2RMSNorm, mistral.MistralRMSNorm)
    attention = {
        llama.LlamaAttention: llama.eager_attention_forward,
        qwen2.Qwen2Attention: qwen2.eager_attention_forward,
    }
    return norms, attention


def fuse_model(model: torch.nn.Module) -> dict[str, int]:
    """Fuse what applies in a peft model: LoRA linears, RMSNorms and rotary passes. Returns the counts."""
    counts = {"lora_linears": fuse_lora_linears(model), "rms_norms": 0, "attention": 0}
    norms, attention = _llama_family()
    for m in model.modules():
        if type(m) in norms:
            _patch(m, _fused_norm_forward)
            counts["rms_norms"] += 1
        elif type(m) in attention:
            m._stock_attention = attention[type(m)]
            _patch(m, _fused_attention_forward)
            counts["attention"] += 1
    return counts
