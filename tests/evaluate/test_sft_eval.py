"""`dtrain eval` of an SFT run's adapter: on a held-out chat file, in the run's format, field mapping
and masking (read from its config.json), the loss is the mean over the assistant tokens only, as
stock transformers + peft compute it with the saved adapter; without --data, the run's own held-out
set gives the run's logged figure; prompts go through the chat template."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lora.sft_fixtures import chat_records, make_model_dir, make_tokenizer, write
from runs import in_process, isolated_env, only_run

from evaluate.conftest import cli

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.evaluate import __main__ as evaluate_main  # noqa: E402
from dtrain.lora import train as lora_train  # noqa: E402

ARGS = ["--seq-len", "96", "--batch-size", "4", "--max-steps", "4", "--lr", "5e-3", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    model = make_model_dir(tmp / "m", make_tokenizer())
    data = write(chat_records(40), tmp / "chat.jsonl")
    mp = pytest.MonkeyPatch()
    try:
        assert in_process(lora_train.main, ["--model", str(model), "--data", str(data), *ARGS,
                                            "--output", str(tmp / "runs")], mp) == 0  # fmt: skip
    finally:
        mp.undo()
    return only_run(tmp / "runs"), model


def reference_loss(model_dir: Path, adapter: Path, held: Path) -> tuple[float, int]:
    """Mean cross-entropy over the assistant tokens of `held`, with stock transformers + peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dtrain.lora import sft
    from dtrain.lora.config import LoraConfig
    from dtrain.lora.data import read_rows
    from dtrain.lora.model import HFTokenizer

    rows = read_rows(str(held), "text")
    enc = sft.encode(HFTokenizer(make_tokenizer()), rows, sft.resolve_fields(rows, LoraConfig(model="m", data="d")),
                     False, 96)  # fmt: skip
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in enc.examples:
            logits = model(input_ids=torch.tensor([ex.ids])).logits[0, :-1]
            labels = torch.tensor(ex.labels[1:])
            keep = labels != sft.IGNORE
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count, count


def test_eval_of_a_held_out_chat_file_counts_only_assistant_tokens(chat_run, tmp_path):
    run, model_dir = chat_run
    held = write(chat_records(6, seed=11), tmp_path / "held.jsonl")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("why is the dog big\n")
    r = cli(tmp_path, "eval", str(run), "--json", "--data", str(held), "--prompts", str(prompts),
            "--max-new-tokens", "5", env=isolated_env(tmp_path))  # fmt: skip
    assert r.code == 0, r.out + r.err
    m = json.loads(r.out)["metrics"]
    want, trained = reference_loss(model_dir, run / "final" / "adapter", held)
    assert m["format"] == "chat" and m["data"] == str(held) and m["blocks"] == 6
    assert m["trained_tokens"] == trained < m["tokens"]  # the prompts and user turns are not scored
    assert m["loss"] == pytest.approx(want, abs=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    (s,) = m["samples"]
    assert s["prompt"] == "why is the dog big" and 0 < s["tokens"] <= 5


def test_eval_without_data_is_the_runs_own_held_out_figure(chat_run, monkeypatch, capsys):
    run, _ = chat_run
    eid = "eval-20260101-000000-abcd"
    code = evaluate_main.main(["eval", str(run), "--max-new-tokens", "3", "--device", "cpu", "--eval-id", eid])
    assert code == 0, capsys.readouterr().err
    record = json.loads((run / "eval" / f"{eid}.json").read_text())
    final = json.loads((run / "status.json").read_text())["result"]
    assert record["metrics"]["format"] == "chat"
    assert record["metrics"]["loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
    # default prompts: the held-out examples' prompts, which end where the assistant's answer starts
    assert record["metrics"]["samples"] and all(s["continuation"] is not None for s in record["metrics"]["samples"])
