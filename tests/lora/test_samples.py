"""Greedy completions at the end of a LoRA run (dtrain.lora.samples): the --sample-prompts file's
prompts rendered through the chat template of a chat run, or the held-out examples' prompts, written
whole to the run's samples.jsonl; a stopped and resumed run, and a finished run resumed again, leave
one record per prompt."""

from __future__ import annotations

import json

import pytest
from runs import in_process, only_run

from lora.sft_fixtures import chat_records, make_model_dir, make_tokenizer, write

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common import workload  # noqa: E402
from dtrain.lora import train as lora_train  # noqa: E402

ARGS = ["--seq-len", "96", "--batch-size", "4", "--max-steps", "4", "--lr", "5e-3", "--checkpoint-every", "2",
        "--sample-tokens", "6"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "m", make_tokenizer())


def samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_chat_run_completes_the_prompt_file_through_its_template_once(tmp_path, monkeypatch, model_dir):
    data = write(chat_records(40), tmp_path / "chat.jsonl")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("why is the cat red\n\nhow big is a dog\n")
    argv = ["--model", str(model_dir), "--data", str(data), *ARGS, "--output", str(tmp_path / "runs"),
            "--sample-prompts", str(prompts)]  # fmt: skip
    with monkeypatch.context() as m:  # stopped at step 2 (checkpointed, exit PREEMPTED): no samples yet
        m.setattr(workload.Context, "stop_requested", lambda self, step: step == 2)
        assert in_process(lora_train.main, argv, m) == 3
    run = only_run(tmp_path / "runs")
    assert not (run / "samples.jsonl").exists()
    resume = ["--resume", run.name, "--output", str(tmp_path / "runs")]
    assert in_process(lora_train.main, resume, monkeypatch) == 0
    first = samples(run)
    assert [s["prompt"] for s in first] == ["why is the cat red", "how big is a dog"]
    for s in first:
        # the chat template's rendering: BOS, a user turn, the generation prompt opening the answer
        assert s["rendered"] == f"<s><|user|>{s['prompt']}<|end|><|assistant|>", s
        assert 1 <= s["tokens"] <= 6 and s["completion"].strip(), s
        assert s["source"] == "--sample-prompts"
    # Resuming the finished run again rewrites the file whole: still one record a prompt, the same ones.
    assert in_process(lora_train.main, resume, monkeypatch) == 0
    assert samples(run) == first


def test_default_prompts_are_the_held_out_examples_prompts(tmp_path, monkeypatch, model_dir):
    data = write(chat_records(40), tmp_path / "chat.jsonl")
    held = write(chat_records(5, seed=7), tmp_path / "held.jsonl")
    argv = ["--model", str(model_dir), "--data", str(data), "--eval-data", str(held), *ARGS,
            "--output", str(tmp_path / "runs"), "--samples", "2"]  # fmt: skip
    assert in_process(lora_train.main, argv, monkeypatch) == 0
    got = samples(only_run(tmp_path / "runs"))
    assert len(got) == 2 and all(s["source"] == "eval set" and s["tokens"] >= 1 for s in got)
    # each prompt is a held-out conversation up to its first assistant answer (which ones: packing orders the
    # held-out examples by length, best fit first), and no conversation twice
    prompts = {
        f"<s><|user|>{next(m['content'] for m in rec['messages'] if m['role'] == 'user')}<|end|><|assistant|>"
        for rec in chat_records(5, seed=7)
    }
    assert all(s["rendered"] in prompts for s in got), (got, prompts)
    assert len({s["rendered"] for s in got}) == len(got)


def test_a_missing_prompt_file_stops_the_run_in_one_line_before_loading(tmp_path, monkeypatch, model_dir, capsys):
    data = write(chat_records(10), tmp_path / "chat.jsonl")
    argv = ["--model", str(model_dir), "--data", str(data), *ARGS, "--output", str(tmp_path / "runs"),
            "--sample-prompts", str(tmp_path / "nope.txt")]  # fmt: skip
    assert in_process(lora_train.main, argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(f"--sample-prompts {tmp_path / 'nope.txt'}: no such file" in line for line in err)
