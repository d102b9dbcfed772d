"""`dtrain eval` on real runs: the figures equal the ones the run logged for the same weights, and the
per-class figures and the confusion matrix add up to them, counted against the labels themselves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from runs import isolated_env

from dtrain.mnist.data import read_idx

from .conftest import FASHION, MNIST_STEPS, cli, result


def eval_json(run: Path, *args: str) -> dict:
    r = cli(run.parent.parent, "eval", str(run), "--json", *args, env=isolated_env(run.parent.parent))
    assert r.code == 0, r.out + r.err
    record = json.loads(r.out)
    on_disk = json.loads((run / "eval" / f"{record['id']}.json").read_text())
    assert on_disk == record  # what the command shows is what it kept under the run
    return record


def test_mnist_eval_equals_the_runs_final_accuracy(mnist_run: Path):
    record = eval_json(mnist_run)
    m = record["metrics"]
    final = result(mnist_run)
    assert record["state"] == "completed" and record["model"] == "final" and record["step"] is None
    assert m["images"] == 1000 and m["split"] == "test[:1000]"
    assert m["accuracy"] == final["accuracy"]  # the same weights, data and arithmetic: the same figure
    assert 0.5 < m["accuracy"] < 1.0  # a trained model, not chance (0.1) and not a constant
    assert record["logged"]["eval_accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)

    # The confusion matrix against the labels themselves: rows are the true classes.
    labels = read_idx(FASHION / "t10k-labels-idx1-ubyte.gz")[:1000].long()
    counts = torch.bincount(labels, minlength=10).tolist()
    matrix = torch.tensor(m["confusion_matrix"])
    assert matrix.shape == (10, 10)
    assert matrix.sum(1).tolist() == counts == m["class_counts"]
    assert matrix.diagonal().sum().item() / 1000 == m["accuracy"]
    per_class = [matrix[c, c].item() / counts[c] for c in range(10)]
    assert m["per_class_accuracy"] == pytest.approx(per_class)
    assert len(set(m["per_class_accuracy"])) > 1  # classes differ: the figures are per class


def test_mnist_eval_of_the_last_checkpoint_equals_the_final_model(mnist_run: Path):
    """The last checkpoint holds the final weights; the middle one is a different model."""
    last = eval_json(mnist_run, "--checkpoint", str(MNIST_STEPS))
    assert last["step"] == MNIST_STEPS and last["model"] == f"checkpoint step {MNIST_STEPS}"
    assert last["metrics"]["accuracy"] == result(mnist_run)["accuracy"]
    assert last["metrics"]["confusion_matrix"] == eval_json(mnist_run)["metrics"]["confusion_matrix"]
    middle = eval_json(mnist_run, "--checkpoint", "16")
    assert middle["metrics"]["confusion_matrix"] != last["metrics"]["confusion_matrix"]
    assert middle["logged"] == {}  # the run evaluates at epoch ends only: nothing logged at step 16


def test_mnist_eval_shows_the_table(mnist_run: Path):
    r = cli(mnist_run.parent.parent, "eval", mnist_run.name, "--output", str(mnist_run.parent))
    assert r.code == 0, r.out + r.err
    accuracy = result(mnist_run)["accuracy"]
    assert f"accuracy {accuracy:.4f} (the run logged {accuracy:.4f})" in r.out
    assert "confusion matrix (rows: true class, columns: predicted)" in r.out


def test_lora_eval_equals_the_runs_final_loss_and_samples_the_prompts(lora_run: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def wrap(text):\n\n    return \n")
    record = eval_json(lora_run, "--prompts", str(prompts), "--max-new-tokens", "8")
    m, final = record["metrics"], result(lora_run)
    assert m["loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
    assert m["perplexity"] == pytest.approx(final["eval_perplexity"], rel=1e-6)
    assert math.exp(m["loss"]) == pytest.approx(m["perplexity"])
    assert m["blocks"] >= 1 and m["tokens"] == m["blocks"] * 64
    assert [s["prompt"] for s in m["samples"]] == ["def wrap(text):", "    return "]  # blank lines skipped
    # At most 8 new tokens each (fewer if end-of-text came first).
    assert all(s["continuation"] and 0 < s["tokens"] <= 8 for s in m["samples"]), m["samples"]


def test_lora_checkpoint_eval_and_default_prompts(lora_run: Path):
    """A middle checkpoint is another adapter (another loss); without prompts, held-out text is continued."""
    record = eval_json(lora_run, "--checkpoint", "3", "--max-new-tokens", "8")
    assert record["metrics"]["loss"] != pytest.approx(result(lora_run)["eval_loss"], rel=1e-6)
    samples = record["metrics"]["samples"]
    assert len(samples) >= 1 and all(s["prompt"] and s["continuation"] for s in samples)
