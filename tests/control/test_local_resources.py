"""Resource curves of a real run on this machine (`dtrain train t.py`, 2 ranks under torchrun): the node's rows
in resources/, each rank's peak in status.json, both in `dtrain runs --json`; a bad interval is one line."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from runs import cli, isolated_env

MIB = 1 << 20
INTERVAL_S = 0.5
# Each rank holds 64 MiB (every page touched) and keeps a core busy for 3 s.
PROGRAM = """
import os, time
held = bytearray(64 << 20)
held[::4096] = b"x" * len(held[::4096])
end = time.time() + 3
while time.time() < end:
    sum(range(10_000))
print("rank", os.environ["RANK"], "done", flush=True)
"""


def test_a_local_run_records_its_nodes_curves_and_each_ranks_peak(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(PROGRAM)
    env = isolated_env(tmp_path, DTRAIN_SAMPLE_INTERVAL=str(INTERVAL_S))
    r = cli(tmp_path, "train", "t.py", "--nproc", "2", "--output", "out", env=env)
    assert r.code == 0, r.out + r.err
    (run,) = (tmp_path / "out").iterdir()
    host = os.uname().nodename
    rows = [json.loads(x) for x in (run / "resources" / f"{host}.jsonl").read_text().splitlines()]
    times = [x["time"] for x in rows]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(rows) >= 5 and all(g > 0 for g in gaps)  # increasing
    # One row every interval while the job ran: as many rows as its span holds (give or take a late one).
    assert abs(len(rows) - ((times[-1] - times[0]) / INTERVAL_S + 1)) <= 2, gaps
    assert INTERVAL_S * 0.9 <= statistics.median(gaps) <= INTERVAL_S * 2, gaps
    assert all(x["node"] == host and 0 <= x["cpu_pct"] <= 100 and 0 < x["mem_used"] < x["mem_total"] for x in rows)
    assert max(x["cpu_pct"] for x in rows) > 20  # two ranks kept cores busy
    both = [x for x in rows if set(x["ranks"]) == {"0", "1"}]
    assert both and all(x["tree_rss"] >= sum(r["rss"] for r in x["ranks"].values()) for x in both)

    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed"
    peaks = status["peak_memory"]
    assert set(peaks) == {"0", "1"}
    for p in peaks.values():
        assert p["node"] == host and 64 * MIB <= p["rss_peak"] < 4096 * MIB
        assert "gpu_peak" not in p  # no GPU here

    listed = cli(tmp_path, "runs", "--json", "--output", "out", env=env)
    assert listed.code == 0, listed.err
    (row,) = json.loads(listed.out)
    assert row["peak_memory"] == peaks
    assert row["resources"][host]["time"] == times  # under 120 samples: every one


def test_a_negative_sample_interval_is_one_line_and_nothing_is_made(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print('never')\n")
    env = isolated_env(tmp_path, DTRAIN_SAMPLE_INTERVAL="-1")
    r = cli(tmp_path, "train", "t.py", "--output", "out", env=env)
    assert r.code == 2
    assert r.err.strip().splitlines() == [
        "error: invalid configuration: run.sample_interval (from DTRAIN_SAMPLE_INTERVAL): must be >= 0 seconds "
        "(0: off), got -1.0"
    ]
    assert not (tmp_path / "out").exists()
