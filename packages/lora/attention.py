"""Packed attention that skips the masked blocks where flash-attention is not installed: SDPA run
causally on each packed document on its own (`--attention sdpa_packed`).

A packed row holds several documents end to end, their position ids restarting at 0 at each one
(dtrain.lora.sft). transformers' stock "sdpa" turns that into a dense B x 1 x L x L block-diagonal
mask and runs SDPA over all L x L blocks, masked ones included; flash-attention 2's varlen call
takes the documents' offsets instead (where the flash_attn package is installed, on an Ampere or
later GPU). This module gives transformers one more attention implementation, registered under
PACKED_SDPA with its AttentionInterface and AttentionMaskInterface:

- the mask function builds no mask for a batch without padding (no 2-D attention mask) whose
  queries and keys are the same tokens (training, a prefill), in a layer with no sliding window:
  the documents are read from the position ids instead. Anything else (a padding mask, a cache, a
  window) gets stock sdpa's mask;
- the attention function cuts each row at the positions where the position id does not follow
  the one before it, and runs causal SDPA (no mask: its fused kernel) on each document, its
  output the documents' outputs end to end. With a mask, it is stock sdpa.

The work is the sum of the documents' squares instead of L squared, and no L x L mask exists.
docs/decisions.md ("Packed attention") has the measurements against the dense mask and against
flex attention (benchmarks/packed_attention.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

PACKED_SDPA = "sdpa_packed"
# The last position ids seen and their document lengths: every layer of a forward (and a checkpointed
# layer's recompute) gets the same tensor, so the lengths are read off it once, not once a layer (on a
# GPU, each read waits for the device).
_last: tuple[weakref.ref, int, list[list[int]]] | None = None


def _lengths_of(position_ids: torch.Tensor) -> list[list[int]]:
    global _last
    if _last is not None and _last[0]() is position_ids and _last[1] == position_ids._version:
        return _last[2]
    lengths = document_lengths(position_ids)
    _last = (weakref.ref(position_ids), position_ids._version, lengths)
    return lengths


def document_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """For each row of `position_ids` (B x L, or 1 x L for all rows), the lengths of its documents:
    a document starts where a position id is not the one before it plus one."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    out = []
    for row in starts.cpu():  # one small copy a layer; the lengths decide the shapes below
        at = row.nonzero().flatten().tolist() + [pos.shape[-1]]
        out.append([b - a for a, b in zip(at, at[1:], strict=False)])
    return out


def packed_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask where packed_sdpa_attention reads the documents from the position ids (see the module
    docstring); stock sdpa's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    plain = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and plain and q_length == kv_length and kwargs.get("local_size") is None:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (query B x H x L x D, key/value B x Hkv x L x D;
    returns B x L x H x D): causal SDPA per document of each row, or stock sdpa with a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2] or query.shape[2] < 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows = _lengths_of(position_ids)
    if len(rows) == 1 and query.shape[0] > 1:  # one row of position ids for the whole batch
        rows = rows * query.shape[0]
    out = [
        _causal_per_document(query[b : b + 1], key[b : b + 1], value[b : b + 1], lens, dropout, scaling)
        for b, lens in enumerate(rows)
    ]
    return torch.cat(out), None


def _causal_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], dropout: float, scale: float | None
) -> torch.Tensor:
    """One row (1 x H x L x D): causal SDPA over each document, as 1 x L x H x D. Four dimensions:
    torch's CPU flash kernel takes no other (three go to the math kernel, scores and all). split, not
    slicing: its backward is one concatenation, where a slice's is a full-size zero tensor a document."""
    from dtrain.lora.fused import grouped_heads_fused

    if q.shape[1] != k.shape[1] and not grouped_heads_fused(q, k, v, dropout):
        rep = q.shape[1] // k.shape[1]  # a GPU whose fused kernels refuse grouped heads: repeat them
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    gqa = q.shape[1] != k.shape[1]
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, dropout_p=dropout, scale=scale, is_causal=qd.shape[2] > 1, enable_gqa=gqa
        )
        for qd, kd, vd in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
    ]
    return torch.cat(outs, 2).transpose(1, 2)


def register() -> None:
    """Make PACKED_SDPA a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
