"""`dtrain plan --attention` takes `dtrain train lora`'s choices and plans what each runs: `auto` (the
default), `sdpa_packed` and `flash_attention_2` keep no dense mask for packed rows; `sdpa` keeps transformers'
B x L x L per-document mask (it planned the dense mask by default while training's auto ran without one)."""

from __future__ import annotations

import json

import pytest
from runs import cli


def activations(tmp_path, *args: str) -> int:
    r = cli(tmp_path, "plan", "--model", "tiny-llama", "--seq-len", "2048", "--batch", "2", "--packed",
            "--accelerator", "nvidia-l4", "--activation-checkpointing", "on", "--json", *args)  # fmt: skip
    assert r.code == 0, r.err
    return json.loads(r.out)["plan"]["memory"]["activations"]


def test_the_default_plans_what_training_runs_and_sdpa_adds_its_masks(tmp_path):
    default = activations(tmp_path)
    assert [activations(tmp_path, "--attention", a) for a in ("auto", "sdpa_packed", "flash_attention_2")] == [
        default
    ] * 3
    # the dense mask: 2 x 2048 x 2048 booleans (an input of every layer) and one layer's 16-bit copy of it
    assert activations(tmp_path, "--attention", "sdpa") - default >= 2 * 2048 * 2048


@pytest.mark.parametrize("bad", ["flash", "dense"])
def test_an_unknown_attention_is_one_line(tmp_path, bad):
    r = cli(tmp_path, "plan", "--model", "tiny-llama", "--packed", "--attention", bad)
    assert r.code == 2 and bad in r.err and len(r.err.strip().splitlines()) == 1, r.err
