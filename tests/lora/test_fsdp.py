"""Sharded LoRA (--sharding fsdp: FSDP2) through the real CLI, 2 gloo processes on the CPU, tiny-llama:
the adapter equals the DDP run's, loads with stock peft, merges (--merge) into a plain model that gives
the adapter's logits, and a sharded run stopped by SIGTERM resumes to the same adapter as an unbroken one,
sharded or (from a copy of its checkpoint) unsharded.
Each run takes 20-40 s on 2 shared cores, so the module is slow."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import runs
import torch
from runs import assert_no_workers_left, latest_step, metrics, only_run, run_dir_of, wait_for
from safetensors.torch import load_file

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

pytestmark = pytest.mark.slow

STEPS = 20
ARGS = ["--model", "tiny-llama", "--seq-len", "64", "--batch-size", "8", "--lr", "2e-3", "--max-steps", str(STEPS),
        "--checkpoint-every", "4", "--eval-every", "10", "--nproc", "2", "--output", "runs"]  # fmt: skip
LOG_EVERY = {"DTRAIN_LOG_EVERY": "2"}
TIMEOUT_S = 400


def train(cwd: Path, corpus: Path, *extra: str) -> Path:
    r = runs.dtrain(["train", "lora", *ARGS, "--data", str(corpus), *extra], cwd, timeout=TIMEOUT_S, **LOG_EVERY)
    assert r.returncode == 0, r.stdout + r.stderr
    return only_run(cwd / "runs")


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


def evals(run: Path) -> dict[int, float]:
    return {m["step"]: m["eval_loss"] for m in metrics(run) if "eval_loss" in m}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, corpus) -> Path:
    return train(tmp_path_factory.mktemp("ddp"), corpus)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, corpus) -> Path:
    return train(tmp_path_factory.mktemp("fsdp"), corpus, "--sharding", "fsdp", "--merge")


def test_the_sharded_run_writes_the_ddp_runs_adapter(ddp, sharded):
    log = (sharded / "config.json").read_text()
    assert json.loads(log)["config"]["sharding"] == "fsdp"
    a, b = adapter(ddp), adapter(sharded)
    assert len(a) == 4 * 7 * 2  # layers x targets x (A, B)
    # The same arithmetic; only the gradient reduction's summation order differs (measured: 1.1e-7).
    assert max_diff(a, b) < 1e-5
    assert losses(sharded) == pytest.approx(losses(ddp), rel=1e-5)
    assert len(losses(sharded)) == STEPS // 2
    ev = evals(sharded)
    assert sorted(ev) == [0, 10, 20] and ev[20] < ev[0] - 1.0  # eval loss 5.61 -> 4.1 measured
    assert ev == pytest.approx(evals(ddp), rel=1e-5)


def test_stock_peft_loads_the_sharded_adapter_and_the_merge_matches_it(sharded):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dtrain.lora.model import load_base

    base, _ = load_base("tiny-llama", torch.float32, seed=0)  # the run's base: seed 0's random weights
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = base(input_ids=x).logits
        model = PeftModel.from_pretrained(base, str(sharded / "final" / "adapter")).eval()
        loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
        assert len(loaded) == 56
        after = model(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(str(sharded / "final" / "merged")).eval()
        assert not [n for n in merged.state_dict() if "lora" in n]
        from_merged = merged(input_ids=x).logits
    assert (after - before).abs().max().item() > 1e-2  # the adapter does something
    assert (from_merged - after).abs().max().item() < 1e-4


def test_a_sharded_run_stopped_by_sigterm_resumes_to_the_same_adapter(tmp_path, corpus, sharded):
    proc = runs.start(
        ["train", "lora", *ARGS, "--data", str(corpus), "--sharding", "fsdp"],
        tmp_path,
        **LOG_EVERY,
        DTRAIN_INTERNAL_FAULT_PAUSE_BEFORE_COMMIT="0.3",
    )
    run = run_dir_of(tmp_path, proc)
    wait_for(lambda: latest_step(run) >= 4, proc, timeout=TIMEOUT_S, what="a checkpoint at step 4")
    proc.send_signal(signal.SIGTERM)  # as a spot VM's shutdown would, to the launcher
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    stopped = latest_step(run)
    assert 4 <= stopped < STEPS
    assert_no_workers_left([run])

    # The checkpoint holds what a DDP run's does: a copy of the stopped run resumes unsharded.
    unsharded = run.with_name(run.name + "-ddp")
    shutil.copytree(run, unsharded)

    r = runs.dtrain(["train", "lora", "--resume", run.name, "--output", "runs"], tmp_path, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"(step {stopped})" in r.stdout
    assert max_diff(adapter(run), adapter(sharded)) <= 1e-6
    r = runs.dtrain(["train", "lora", "--resume", str(unsharded), "--sharding", "ddp"], tmp_path, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"(step {stopped})" in r.stdout and "replicated (DDP)" in r.stdout
    assert max_diff(adapter(unsharded), adapter(sharded)) < 1e-5  # DDP's summation order from the stop on
    # (A metric row's loss is the mean over the steps since the last row: the row after the resume
    # covers fewer steps, so rows are not compared; the evaluations are.)
    assert evals(run)[STEPS] == pytest.approx(evals(sharded)[STEPS], abs=1e-6)
