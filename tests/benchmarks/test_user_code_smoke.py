"""benchmarks/user_code.py with tiny settings: the checkpoint-copy part really runs both ways through the
real CLI, and its figures agree with its --json (the start and sync parts need the root-only test bed and
run in the benchmark itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "user_code.py"
ROUND = re.compile(r"^ckpt round 1: copy on ([\d.]+) steps/s, off ([\d.]+) steps/s \(load [\d. ]+\)$")


@pytest.mark.slow
def test_checkpoint_copy_part_prints_figures_that_parse(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--only", "ckpt", "--rounds", "1", "--ckpt-steps", "20",
           "--ckpt-interval", "0.5", "--ckpt-every", "5", "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("ckpt round")]
    m = ROUND.match(line)
    assert m, line
    figures = json.loads(out.read_text())["ckpt"]
    assert figures["on_steps_s"]["median"] == pytest.approx(float(m.group(1)), abs=0.01)
    assert figures["off_steps_s"]["median"] == pytest.approx(float(m.group(2)), abs=0.01)
    assert figures["on_over_off"]["median"] == pytest.approx(float(m.group(1)) / float(m.group(2)), rel=0.01)
    assert figures["interval_s"] == 0.5
