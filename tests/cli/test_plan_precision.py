"""`dtrain plan --precision bf16 --accelerator CARD`: the precision is checked against the named card, and
the smallest-cluster search passes over cards without bf16 instead of refusing the whole plan (it said
"NVIDIA T4 16GB has no bf16" for an A100 plan)."""

from __future__ import annotations

import json

from runs import cli


def test_bf16_on_a_card_that_has_it_plans_and_the_cluster_search_skips_cards_without_it(tmp_path):
    from dtrain.lora.plan import _card

    r = cli(tmp_path, "plan", "--model", "tiny-llama", "--precision", "bf16", "--accelerator", "nvidia-a100-80gb",
            "--json")  # fmt: skip
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["plan"]["precision"] == "bf16" and out["fits"]
    assert _card(out["cluster"]["accelerator"]).bf16, out["cluster"]


def test_bf16_on_a_card_without_it_is_still_one_line(tmp_path):
    r = cli(tmp_path, "plan", "--model", "tiny-llama", "--precision", "bf16", "--accelerator", "nvidia-tesla-t4")
    assert r.code == 2, (r.out, r.err)
    assert r.err.strip().splitlines() == ["error: NVIDIA T4 16GB has no bf16: use --precision fp16 (or auto)"]
