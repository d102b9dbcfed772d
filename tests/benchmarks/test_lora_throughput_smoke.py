"""benchmarks/lora_throughput.py end to end in its --quick mode: all three pipelines really run (the
dtrain CLI under torchrun, and transformers' Trainer on padded lines and on packed blocks) on the
same model and data, and report figures that add up."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_throughput.py"
QUICK_TIMED_STEPS = 4  # --quick: 6 steps, the first 2 untimed
BATCH, SEQ = 8, 256
# The preset's random weights start near uniform over its 258 byte tokens; 6 LoRA steps at 2e-4
# take every pipeline's logged loss down by 0.1 to 0.2 (seeded), so 0.05 says they all trained.
START_LOSS = math.log(258)
MIN_LOSS_DROP = 0.05
MISSING = [m for m in ("transformers", "peft", "accelerate") if importlib.util.find_spec(m) is None]


@pytest.mark.slow  # 70 s to 120 s on 2 cores shared with other work
@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (pip install 'dtrain[lora,dev]')")
def test_quick_mode_reports_all_three_pipelines(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "DTRAIN_OFFLINE": "1"}, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    figures = json.loads(out.read_text())
    pipes = figures["pipelines"]
    assert set(pipes) == {"ours", "trainer-padded", "trainer-packed"}
    for name, p in pipes.items():
        assert p["timed_steps"] == QUICK_TIMED_STEPS, name
        assert p["tokens_per_s"] > 0 and p["timed_s"] > 0, name
        assert p["tokens_per_s"] == pytest.approx(p["real_tokens"] / p["timed_s"]), name
        assert 100 < p["peak_rss_mib"] < 16 * 1024, name  # a torch process, and no runaway
        assert abs(p["first_loss"] - START_LOSS) < 0.5, name
        assert p["last_loss"] < p["first_loss"] - MIN_LOSS_DROP, name
        assert p["mfu"] is None or 0 < p["mfu"] < 1, name
    # Packed blocks: every slot is a real token, and the timed steps hold exactly batch x seq each.
    full = QUICK_TIMED_STEPS * BATCH * SEQ
    assert pipes["ours"]["real_tokens"] == pipes["trainer-packed"]["real_tokens"] == full
    assert pipes["ours"]["real_fraction"] == pipes["trainer-packed"]["real_fraction"] == 1.0
    # Lines padded to the longest in the batch: some slots are padding, and a line is at most seq.
    padded = pipes["trainer-padded"]
    assert 0 < padded["real_fraction"] < 1
    assert 0 < padded["real_tokens"] < full
    # Both baselines train the same adapter as dtrain: r 8 on the 7 projections of 4 layers.
    per_layer = 8 * sum(i + o for i, o in [(256, 256)] * 4 + [(256, 688), (256, 688), (688, 256)])
    assert pipes["trainer-padded"]["extra"]["trainable_params"] == 4 * per_layer
    assert pipes["trainer-packed"]["extra"]["trainable_params"] == 4 * per_layer

    r = figures["ratios"]
    assert r["ours_over_packed"] == pytest.approx(
        pipes["ours"]["tokens_per_s"] / pipes["trainer-packed"]["tokens_per_s"]
    )
    params = figures["parameters"]
    assert figures["flops_per_token"] == 4 * params["matmul_weights"] + params["attention_flops_per_token"]
    assert figures["settings"]["precision"] == "fp32"  # the default on a CPU
    assert "ours / trainer-packed = " in proc.stdout
    assert "trainer-packed / trainer-padded = " in proc.stdout
