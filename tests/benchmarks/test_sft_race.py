"""sft_throughput.py's fairness checks: the SDPA probe tells a per-document causal mask from one that
lets packed documents see each other, and check_fair refuses a run that did not get its row's work."""

from __future__ import annotations

import benchmark_scripts
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def race():
    m = benchmark_scripts.load_script("sft_throughput")
    stock = torch.nn.functional.scaled_dot_product_attention
    yield m
    torch.nn.functional.scaled_dot_product_attention = stock


def per_document(lengths: list[int]) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(doc)
    return (torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :]))[None, None]


def attend(mask: torch.Tensor | None, n: int, causal: bool = False) -> None:
    q = torch.randn(1, 2, n, 4, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=causal)


def test_probe_reads_per_document_masks(race):
    stock = torch.nn.functional.scaled_dot_product_attention
    seen = race.probe_attention(calls=2)
    assert torch.nn.functional.scaled_dot_product_attention is not stock
    attend(per_document([3, 2]), 5)
    with torch.no_grad():  # evaluation and the isolation check: not training work
        attend(None, 5, causal=True)
    attend(per_document([1, 2, 2]), 5)
    out = race.attention_summary(seen)
    assert out["masks"] == {"dense bool mask (1, 1) x L x L": 2}
    assert out["per_document_causal"] is True
    assert out["documents_per_row"] == 2.5
    assert out["attended_share_of_causal"] == round((6 + 3 + 1 + 3 + 3) / 30, 3)
    assert torch.nn.functional.scaled_dot_product_attention is stock  # put back after 2 calls
    attend(None, 5, causal=True)
    assert race.attention_summary(seen)["sdpa_calls"] == 2


def test_probe_catches_a_mask_across_documents(race):
    seen = race.probe_attention(calls=1)
    leaky = per_document([3, 2]).clone()
    leaky[0, 0, 4, 0] = True  # the second document sees the first one's first token
    attend(leaky, 5)
    assert race.attention_summary(seen)["per_document_causal"] is False


def test_probe_names_the_causal_flag(race):
    seen = race.probe_attention(calls=1)
    attend(None, 5, causal=True)
    out = race.attention_summary(seen)
    assert out["masks"] == {"is_causal": 1}
    assert out["documents_per_row"] == 1


def run(checkpointing: bool, masks: dict, docs: float = 3.0, trainable: int = 10) -> dict:
    attention = {"sdpa_calls": 32, "masks": masks, "per_document_causal": True, "documents_per_row": docs}
    return {"checkpointing": checkpointing, "attn_implementation": "sdpa", "trainable": trainable,
            "attention": attention}  # fmt: skip


def test_check_fair(race):
    dense = {"dense bool mask (1, 1) x L x L": 32}
    first = run(False, dense)
    race.check_fair("A", "trl", first, None)
    race.check_fair("A", "dtrain-fused", run(False, dense), first)
    race.check_fair("B", "trl", run(True, dense), None)
    # a row of one document (plain causal) among the first calls of one side only: its sampler's order
    race.check_fair("A", "dtrain-fused", run(False, {**dense, "is_causal": 4}), first)
    for bad, row in (
        (run(True, dense), "A"),  # checkpointing on in the row that has it off
        (run(False, {"is_causal": 32}), "A"),  # not the other side's masks
        (run(False, dense, docs=1.0), "A"),  # no packed documents seen: attended across them, or not packed
        (run(False, dense, trainable=11), "A"),  # other LoRA targets
    ):
        with pytest.raises(SystemExit, match="not the race's work"):
            race.check_fair(row, "dtrain-fused", bad, first)
