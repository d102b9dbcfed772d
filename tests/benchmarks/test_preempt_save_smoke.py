"""benchmarks/preempt_save.py with tiny settings: the SIGTERM-path save really runs (the workload's
Checkpointer, into a local directory and a gs:// bucket on the storage emulator), and every line it prints
parses into figures that agree with its --json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "preempt_save.py"
SAVE = re.compile(
    r"^save (local|gs \(emulator\)): median ([\d.]+) s of (\d+) \(min ([\d.]+), max ([\d.]+)\); "
    r"checkpoint ([\d.]+) MB; ([\d.]+)% of the 30 s notice$"
)
RATE = re.compile(
    r"^rate (local|gs \(emulator\)): a (\d+) MB state saved in median ([\d.]+) s of (\d+): ([\d.]+) MB/s$"
)
ESTIMATE = re.compile(
    r"^estimate (local|gs \(emulator\)): (7B .+?), ([\d.]+) GB at ([\d.]+) MB/s: (\d+) s, "
    r"(fits|does NOT fit) in the 30 s notice$"
)


@pytest.mark.slow  # 36 s on 2 cores shared with other work (importing transformers and peft is most of it)
def test_tiny_run_prints_figures_that_parse(tmp_path: Path, gcs_emulator: str) -> None:
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny-llama", "--steps", "1", "--saves", "2", "--big-mb", "4",
           "--seq-len", "16", "--gcs", gcs_emulator, "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("preset tiny-llama: 3.5M parameters, 0.156M trainable (LoRA r=8 on q_proj")
    saves = [SAVE.match(ln) for ln in lines if ln.startswith("save ")]
    rates = [RATE.match(ln) for ln in lines if ln.startswith("rate ")]
    estimates = [ESTIMATE.match(ln) for ln in lines if ln.startswith("estimate ")]
    assert all(saves) and all(rates) and all(estimates), proc.stdout
    assert [m.group(1) for m in saves] == [m.group(1) for m in rates] == ["local", "gs (emulator)"]
    figures = json.loads(out.read_text())
    for m, fig in zip(saves, figures["saves"], strict=True):
        median, lo, hi, mb = (float(m.group(i)) for i in (2, 4, 5, 6))
        assert int(m.group(3)) == fig["saves"] == 2 and lo <= median <= hi
        assert mb == round(fig["mb"], 2) and mb > 1.0  # the adapter (0.156M fp32) and AdamW's two moments
        assert float(m.group(7)) == round(100 * fig["median_s"] / 30, 2)
    for m, fig in zip(rates, figures["rates"], strict=True):
        assert int(m.group(2)) == 4 and 0 < fig["mb"] - 4.0 < 0.05  # the 4 MB state, and RNG states and config (~11 kB)
        assert float(m.group(5)) == round(fig["mb_per_s"], 1)
    assert len(estimates) == 4
    for m, est in zip(estimates, figures["estimates"], strict=True):
        gb, rate, seconds = float(m.group(3)), float(m.group(4)), int(m.group(5))
        assert gb == {"7B bf16 weights only": 14.0}.get(m.group(2), 84.0)
        assert seconds == round(est["seconds"]) and (m.group(6) == "fits") is est["fits"] is (est["seconds"] <= 30)
        assert abs(est["seconds"] - est["mb"] / est_rate(figures, est["where"])) < 1e-6 and rate > 0


def est_rate(figures: dict, where: str) -> float:
    return next(r["mb_per_s"] for r in figures["rates"] if r["where"] == where)
