"""Through the CLI: `dtrain train lora --show-example` prints the example and claims no run; the
workload module's --help renders (its help texts hold "%")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from runs import cli, isolated_env

from lora.sft_fixtures import alpaca_records, make_model_dir, make_tokenizer, write

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")


def test_show_example_through_the_cli_claims_no_run(tmp_path: Path):
    model = make_model_dir(tmp_path / "m", make_tokenizer())
    data = write(alpaca_records(5), tmp_path / "a.jsonl")
    r = cli(tmp_path, "train", "lora", "--model", str(model), "--data", str(data), "--nproc", "1",
            "--output", "runs", "--show-example", env=isolated_env(tmp_path))  # fmt: skip
    assert r.code == 0, r.out + r.err
    assert "first example (" in r.out and "⟦" in r.out
    assert "completed" not in r.out + r.err and "config.json" not in r.out
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_workload_help_renders_percent_signs():
    p = subprocess.run(
        [sys.executable, "-m", "dtrain.lora.train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "3% of the run" in p.stdout and "--warmup-steps" in p.stdout
