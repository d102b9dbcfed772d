"""Evaluation with fewer held-out blocks than ranks (gloo, 2 real processes): a rank with nothing
to evaluate must not skip a collective its peers make. Through the DDP wrapper the forward pass
broadcast the model's buffers, so rank 0 waited in a broadcast while rank 1 waited in the
all-reduce: the run hung until the collective timeout and then blamed a lost peer."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import runs
from runs import metrics, only_run

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

# 3,200 bytes of text: 24 training blocks and 1 held-out block of 128 byte-tokens.
TEXT_CHARS = 3200
# Short enough that a hang fails this test in well under a minute, long enough for start-up.
DIST_TIMEOUT_S = "30"


def test_one_eval_block_two_ranks_completes(tmp_path: Path):
    data = tmp_path / "small.txt"
    data.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:TEXT_CHARS])
    args = ["train", "lora", "--model", "tiny-llama", "--data", str(data), "--nproc", "2", "--max-steps", "3",
            "--seq-len", "128", "--batch-size", "2", "--output", "runs"]  # fmt: skip
    r = runs.dtrain(args, tmp_path, timeout=180, DTRAIN_DIST_TIMEOUT=DIST_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "24 train / 1 eval blocks of 128" in r.stdout
    evals = {m["step"]: m["eval_loss"] for m in metrics(only_run(tmp_path / "runs")) if "eval_loss" in m}
    assert sorted(evals) == [0, 3]
    # Random weights over 258 byte tokens: the held-out loss starts near log(258) = 5.55.
    assert abs(evals[0] - math.log(258)) < 0.5, evals
    assert math.isfinite(evals[3])
