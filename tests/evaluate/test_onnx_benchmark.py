"""benchmarks/onnx_vs_torch.py runs both backends at both batch sizes and reports figures (a smoke
run: one short round each; the figures themselves are the script's to print, not the test's to judge)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "onnx_vs_torch.py"


def test_smoke_reports_both_backends(tmp_path: Path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--rounds", "1", "--seconds", "0.1", "--threads", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["max_abs_diff"] < 1e-4
    assert set(figures["images_per_s"]) == {"1", "256"}
    for batch, row in figures["images_per_s"].items():
        assert set(row) == {"torch eager", "onnxruntime"}, batch
        assert all(r["median"] > 0 for r in row.values()), batch
    assert "ort / torch" in p.stdout and "torch eager (baseline)" in p.stdout


def test_bad_rounds_are_refused():
    p = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--rounds must be >= 1 and --seconds > 0" in p.stderr
