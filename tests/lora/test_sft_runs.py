"""SFT runs end to end in this process (a tiny Llama and a BPE tokenizer with a chat template, saved
as a local model directory): a run stopped at step 3 and resumed ends with the same adapter and
losses as an unbroken one, for chat data and for Alpaca records in each file format; --eval-data is
what evaluation reads; bad data stops a run in one line, leaving no run behind."""

from __future__ import annotations

import pytest
import torch
from runs import in_process, metrics, only_run
from safetensors.torch import load_file

from lora.sft_fixtures import alpaca_records, chat_records, make_model_dir, make_tokenizer, write

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common import workload  # noqa: E402
from dtrain.lora import train as lora_train  # noqa: E402

ARGS = ["--seq-len", "96", "--batch-size", "4", "--max-steps", "6", "--lr", "5e-3", "--log-every", "1",
        "--checkpoint-every", "2", "--eval-every", "3"]  # fmt: skip
STOP_AT = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "m", make_tokenizer())


def run(tmp_path, monkeypatch, model_dir, data, *extra, stop_at=0, name="runs"):
    out = tmp_path / name
    argv = ["--model", str(model_dir), "--data", str(data), *ARGS, "--output", str(out), *extra]
    if stop_at:  # as a SIGTERM at that step would: checkpoint, then exit PREEMPTED
        with monkeypatch.context() as m:
            m.setattr(workload.Context, "stop_requested", lambda self, step: step == stop_at)
            assert in_process(lora_train.main, argv, m) == 3
        return only_run(out)
    assert in_process(lora_train.main, argv, monkeypatch) == 0
    return only_run(out)


def resume(monkeypatch, run_dir):
    argv = ["--resume", run_dir.name, "--output", str(run_dir.parent)]
    assert in_process(lora_train.main, argv, monkeypatch) == 0


def adapter(run_dir):
    return load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}


def assert_resumes_exactly(tmp_path, monkeypatch, model_dir, data, *extra):
    whole = run(tmp_path, monkeypatch, model_dir, data, *extra, name="whole")
    broken = run(tmp_path, monkeypatch, model_dir, data, *extra, stop_at=STOP_AT, name="broken")
    resume(monkeypatch, broken)
    a, b = adapter(whole), adapter(broken)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert losses(broken) == losses(whole) and len(losses(whole)) == 6
    first, last = losses(whole)[1], losses(whole)[6]
    assert last < first, (first, last)
    return whole


def test_chat_run_resumes_exactly_and_evaluates_the_eval_file(tmp_path, monkeypatch, model_dir, capsys):
    data = write(chat_records(60), tmp_path / "chat.jsonl")
    held = write(chat_records(8, seed=9), tmp_path / "held.parquet")
    whole = assert_resumes_exactly(tmp_path, monkeypatch, model_dir, data, "--eval-data", str(held))
    out = capsys.readouterr().out
    assert "first example (" in out and "⟦" in out and "chat data: loss on completions only" in out

    # Evaluation reads the eval file: the step-0 eval loss is the base model's mean loss over the
    # assistant tokens of held.parquet, computed here without dtrain's loop.
    from transformers import AutoModelForCausalLM

    from dtrain.lora import sft
    from dtrain.lora.data import read_rows
    from dtrain.lora.model import HFTokenizer

    tok = HFTokenizer(make_tokenizer())
    rows = read_rows(str(held), "text")
    examples = sft.encode(tok, rows, sft.resolve_fields(rows, lora_train.LoraConfig(model="m", data="d")), False, 96)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples.examples:
            logits = base(input_ids=torch.tensor([ex.ids])).logits[0, :-1]
            labels = torch.tensor(ex.labels[1:])
            keep = labels != sft.IGNORE
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            count += int(keep.sum())
    (step0,) = [m["eval_loss"] for m in metrics(whole) if m["step"] == 0 and "eval_loss" in m]
    assert step0 == pytest.approx(total / count, abs=1e-5)


@pytest.mark.parametrize(
    "suffix", [".json", *(pytest.param(s, marks=pytest.mark.slow) for s in (".jsonl", ".parquet", ".csv"))]
)  # the readers are tested in test_sft.py; a run on each is the slow suite's
def test_alpaca_run_resumes_exactly(tmp_path, monkeypatch, model_dir, suffix):
    data = write(alpaca_records(80), tmp_path / f"alpaca{suffix}")
    assert_resumes_exactly(tmp_path, monkeypatch, model_dir, data)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_micro_batch(tmp_path, monkeypatch, model_dir):
    """The loss is normalised by the global batch's trained tokens, not per micro-batch: two
    micro-batches of uneven token counts train the same adapter as one."""
    data = write(alpaca_records(80), tmp_path / "alpaca.json")
    one = run(tmp_path, monkeypatch, model_dir, data, name="one")
    two = run(tmp_path, monkeypatch, model_dir, data, "--grad-accum", "2", name="two")
    a, b = adapter(one), adapter(two)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_bad_data_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """Chat data for a model whose tokenizer has no chat template (the byte-level preset)."""
    data = write(chat_records(10), tmp_path / "chat.json")
    out = tmp_path / "runs"
    argv = ["--model", "tiny-llama", "--data", str(data), *ARGS, "--output", str(out)]
    assert in_process(lora_train.main, argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {data}[0]: chat data (field 'messages'), but the model's tokenizer has no chat template to render "
        "it; use a model whose tokenizer has one (an -Instruct/-chat model), or instruction data"
    ]
    assert not out.exists() or not list(out.iterdir())


def test_show_example_prints_and_exits_without_a_run(tmp_path, monkeypatch, model_dir, capsys):
    data = write(alpaca_records(5), tmp_path / "a.csv")
    argv = ["--model", str(model_dir), "--data", str(data), "--output", str(tmp_path / "runs"), "--show-example"]
    assert in_process(lora_train.main, argv, monkeypatch) == 0
    shown = capsys.readouterr().out
    rec = alpaca_records(5)[0]
    assert shown.startswith(f"instruction data, loss on completions only: first example ({data}:2): ")
    assert f"<|user|>{rec['instruction']}<|end|><|assistant|>⟦{rec['output']}<|end|>⟧" in shown
    assert not (tmp_path / "runs").exists()


def test_plain_text_with_an_eval_file(tmp_path, monkeypatch, corpus, micro_llama, capsys):
    """Plain text keeps today's blocks; --eval-data's blocks are the held-out set, all of --data trains."""
    held = tmp_path / "held.txt"
    held.write_text(corpus.read_text()[:3000])  # 3,000 bytes + end-of-text: 93 blocks of 32
    argv = ["--model", micro_llama, "--data", str(corpus), "--eval-data", str(held), "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "2", "--output", str(tmp_path / "runs")]  # fmt: skip
    assert in_process(lora_train.main, argv, monkeypatch) == 0
    out = capsys.readouterr().out
    train_blocks = (len(corpus.read_bytes()) + 1) // 32
    assert f"-> {train_blocks} train / 93 eval blocks of 32" in out
