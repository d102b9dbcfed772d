"""LoRA runs end to end (tiny-llama preset, byte tokenizer, real torchrun + gloo) on the Python
standard library's own source: perplexity falls, DDP equals one process, and a run killed with
-9 and resumed ends with the same adapter as an unbroken one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import runs
from runs import assert_no_workers_left, latest_step, metrics, only_run, peers, run_dir_of, wait_for
from safetensors.torch import load_file

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

# 40 optimizer steps of 8 blocks of 64 byte-tokens, checkpointed every 5, evaluated at 0, 20, 40.
ARGS = [
    "--model",
    "tiny-llama",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--lr",
    "2e-3",
    "--max-steps",
    "40",
    "--checkpoint-every",
    "5",
    "--eval-every",
    "20",
]
LOG_EVERY = {"DTRAIN_LOG_EVERY": "5"}


def train(cwd: Path, corpus: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    return runs.dtrain(
        ["train", "lora", *ARGS, "--data", str(corpus), "--output", "runs", *extra], cwd, **LOG_EVERY, **env
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    cwd = tmp_path_factory.mktemp("ref")
    r = train(cwd, corpus, "--nproc", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    return only_run(cwd / "runs")


def evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval_perplexity"] for r in metrics(run) if "eval_perplexity" in r}


def adapter(run: Path):
    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


def test_perplexity_falls_on_real_text(reference):
    ppl = evals(reference)
    assert sorted(ppl) == [0, 20, 40]
    assert ppl[0] > 200  # an untrained byte model is near uniform over 258 tokens
    assert ppl[40] < ppl[0] / 3, ppl  # stated factor: at least 3x lower after 40 steps
    status = json.loads((reference / "status.json").read_text())
    assert status["result"]["eval_perplexity"] == pytest.approx(ppl[40], rel=1e-6)


def test_two_processes_match_one_with_the_same_global_batch(tmp_path, corpus, reference):
    r = train(tmp_path, corpus, "--nproc", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    single = only_run(tmp_path / "runs")
    one = {m["step"]: m["loss"] for m in metrics(single) if "loss" in m}
    two = {m["step"]: m["loss"] for m in metrics(reference) if "loss" in m}
    assert one.keys() == two.keys() and len(one) == 8
    # No batch statistics in a transformer: only float summation order differs. Stated tolerance 1e-4.
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    assert evals(reference)[40] == pytest.approx(evals(single)[40], rel=1e-4)
    a, b = adapter(single), adapter(reference)
    assert a.keys() == b.keys() and len(a) == 4 * 7 * 2  # layers x targets x (A, B)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_kill_9_then_resume_gives_the_same_adapter(tmp_path, corpus, reference):
    proc = runs.start(
        ["train", "lora", *ARGS, "--data", str(corpus), "--output", "runs", "--nproc", "2"],
        tmp_path,
        **LOG_EVERY,
        DTRAIN_INTERNAL_FAULT_PAUSE_BEFORE_COMMIT="0.3",
    )
    run = run_dir_of(tmp_path, proc)
    wait_for(lambda: latest_step(run) >= 15, proc, what="a checkpoint at step 15")
    victim = next(p for p in peers(run) if p["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    stopped = latest_step(run)
    assert 15 <= stopped < 40
    assert_no_workers_left([run])

    r = runs.dtrain(["train", "lora", "--resume", run.name, "--output", "runs"], tmp_path, **LOG_EVERY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"(step {stopped})" in r.stdout
    got, want = adapter(run), adapter(reference)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    assert evals(run)[40] == pytest.approx(evals(reference)[40], abs=1e-6)


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path, corpus):
    """batch 8 as 2 micro-batches of 4 must train the same adapter as 1 micro-batch of 8."""
    out = {}
    for accum in ("1", "2"):
        cwd = tmp_path / f"accum{accum}"
        cwd.mkdir()
        r = runs.dtrain(
            [
                "train",
                "lora",
                "--model",
                "tiny-llama",
                "--data",
                str(corpus),
                "--seq-len",
                "64",
                "--batch-size",
                "8",
                "--grad-accum",
                accum,
                "--max-steps",
                "6",
                "--lr",
                "2e-3",
                "--nproc",
                "1",
                "--output",
                "runs",
            ],
            cwd,
            DTRAIN_LOG_EVERY="2",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        out[accum] = only_run(cwd / "runs")
    a, b = adapter(out["1"]), adapter(out["2"])
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    la = {m["step"]: m["loss"] for m in metrics(out["1"]) if "loss" in m}
    lb = {m["step"]: m["loss"] for m in metrics(out["2"]) if "loss" in m}
    assert la == pytest.approx(lb, rel=1e-5)


def test_a_local_model_directory_with_its_own_tokenizer(tmp_path, corpus):
    """--model DIR: a Llama and a BPE tokenizer trained here, saved as transformers saves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(
        [str(corpus)],
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    model_dir = tmp_path / "my-model"
    tok.save_pretrained(model_dir)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    ).save_pretrained(model_dir)

    r = runs.dtrain(
        [
            "train",
            "lora",
            "--model",
            str(model_dir),
            "--data",
            str(corpus),
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--max-steps",
            "8",
            "--lr",
            "5e-3",
            "--nproc",
            "1",
            "--output",
            "runs",
        ],
        tmp_path,
        DTRAIN_LOG_EVERY="4",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = only_run(tmp_path / "runs")
    cfg = json.loads((run / "final" / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(model_dir) and cfg["r"] == 8
    ppl = evals(run)
    assert ppl[8] < ppl[0]  # BPE tokens of real text: it learns something in 8 steps
