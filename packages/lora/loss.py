"""Next-token cross-entropy that never holds fp32 logits for every token at once.

The stock step (transformers' loss) computes the logits of every token, upcasts them to fp32, and
cross-entropy keeps fp32 log-probabilities; the backward starts with two more fp32 tensors of that
size: 12 bytes x vocabulary a token, 5.9 GiB for Llama-3.1-8B's 128,256 words at 4,096 tokens, more
than any layer's activations. Here the model returns its final hidden states (its output layer passes
them through while `hidden_states_out` is active) and `chunked_cross_entropy` applies the output layer
and the loss to `chunk` tokens at a time: the forward keeps only each token's log-sum-exp (4 B), and
the backward recomputes one chunk's logits at a time to make the hidden states' gradient. The peak
holds one chunk's fp32 logits and their gradient, whatever the sequence length. torchtune's
CEWithChunkedOutputLoss (its QLoRA and LoRA configs' loss) splits the logits the same way for the
same reason; it keeps every chunk's logits in the compute dtype, this recomputes them.

The arithmetic is the stock one: the logits in the compute dtype (autocast's, or the weights'), upcast
to fp32, the log-sum-exp and the target's logit in fp32; labels equal to IGNORE (-100) take no loss;
the gradient goes back to the hidden states in the compute dtype. A frozen output layer (LoRA's case)
gets no gradient; one that trains gets it summed over the chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

IGNORE = -100
# Tokens per chunk: the fp32 logits of one chunk are CHUNK_TOKENS x vocabulary x 4 B (256 MiB for
# Llama-3's 128,256 words), the same order as one decoder layer's activations at 2,048 tokens.
CHUNK_TOKENS = 512


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The model's output projection (lm_head), through DDP and peft wrappers."""
    inner = getattr(model, "module", model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = base.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(base).__name__} has no output layer for the chunked loss")
    return head


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextlib.contextmanager
def hidden_states_out(head: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """While active, `head` returns its input: the model's "logits" are its final hidden states.
    An instance attribute shadows the class's forward, so the module, its parameters and its state
    dict keys stay as they are (FSDP2 still gathers its weight with the root unit)."""
    head.forward = _pass_through  # type: ignore[method-assign]
    try:
        yield head
    finally:
        del head.forward


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, chunk: int, dtype: torch.dtype):  # noqa: ANN001, ANN205
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                logits = torch.nn.functional.linear(hidden[s : s + chunk].to(dtype), w, b).float()
                t = targets[s : s + chunk]
                chunk_lse = torch.logsumexp(logits, -1)
                picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
                del logits
                total += torch.where(t != IGNORE, chunk_lse - picked, 0.0).sum()
                lse[s : s + chunk] = chunk_lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk].to(dtype)
                t = targets[s : s + chunk]
                # softmax - one-hot(target), scaled by the incoming gradient; zero on ignored tokens
                g = torch.nn.functional.linear(h, w, b).float().sub_(lse[s : s + chunk, None]).exp_()
                keep = t != IGNORE
                rows = torch.arange(t.shape[0], device=t.device)
                g[rows, t.clamp(min=0)] -= 1.0
                g.mul_((keep.to(g.dtype) * grad)[:, None])
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[s : s + chunk] = g @ w
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
                if grad_b is not None:
                    grad_b += g.float().sum(0)
                del g  # before the next chunk's logits: one chunk alive at a time
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int = CHUNK_TOKENS
) -> torch.Tensor:
    """The summed cross-entropy of `head(hidden)` against `targets` (IGNORE: no loss), in fp32,
    `chunk` tokens at a time; `hidden` is (..., h), `targets` the matching (...)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    weight, bias = head.weight, getattr(head, "bias", None)
    return _ChunkedLinearCrossEntropy.apply(h, weight, bias, t, max(1, chunk), _compute_dtype(h, weight))


def causal_lm_loss(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK_TOKENS, **inputs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token loss, trained-token count) of `model` on `ids`: position i predicts
    labels[i + 1]; labels equal to IGNORE take no loss. `inputs` go to the model (position ids)."""
    head = output_layer(model)
    with hidden_states_out(head):
        hidden = model(input_ids=ids, use_cache=False, **inputs).logits
    # The last position predicts nothing: an IGNORE target there keeps `hidden` whole (a view, no copy).
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)
    loss = chunked_cross_entropy(hidden, head, targets, chunk)
    return loss, (targets != IGNORE).sum()
