"""`dtrain runs --json` with the resource curves: each rank's peak memory (status.json) and each node's series
(resources/), from a run folder the recorder wrote (dtrain.common.resources, as a launcher does); the table
reads no curves."""

from __future__ import annotations

import json
from pathlib import Path

from runs import dtrain

from dtrain.common import resources, runrecord
from dtrain.common.storage import open_store
from dtrain.control import runs

MIB = 1 << 20


def recorded_run(out: Path, name: str, rows: int, *, ended: bool = True) -> None:
    run = out / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"workload": "t", "created": 1000.0, "world_size": 2}))
    store = open_store(str(run))
    runrecord.record_start(store, starts=1, host="h0")
    rec = resources.Recorder(store)
    for i in range(rows):
        for node, rank in (("n1", "0"), ("n2", "1")):
            ranks = {rank: {"rss": (100 + i) * MIB, "hwm": (100 + i) * MIB}}
            rec.add(node, {"time": 1000.0 + i, "cpu_pct": float(i % 100), "mem_used": (1 + i) * MIB,
                           "mem_total": 8 << 30, "tree_rss": (100 + i) * MIB, "ranks": ranks})  # fmt: skip
    if ended:
        rec.close()
        runrecord.record_end(store, 0)


def test_runs_json_has_each_ranks_peak_and_each_nodes_compact_series(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    recorded_run(out, "t-a", rows=300)
    p = dtrain(["runs", "--json", "--output", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads(p.stdout)
    assert row["peak_memory"] == {
        "0": {"node": "n1", "rss_peak": 399 * MIB},
        "1": {"node": "n2", "rss_peak": 399 * MIB},
    }
    assert sorted(row["resources"]) == ["n1", "n2"]
    s = row["resources"]["n1"]
    assert len(s["time"]) == runs.SERIES_POINTS and s["time"][0] == 1000.0 and s["time"][-1] == 1299.0
    assert s["time"] == sorted(s["time"]) and len(s["cpu_pct"]) == len(s["mem_used"]) == runs.SERIES_POINTS
    assert s["mem_total"] == 8 << 30


def test_the_runs_table_reads_no_curves(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "runs"
    recorded_run(out, "t-a", rows=3)
    read: list[str] = []
    monkeypatch.setattr(resources, "read_series", lambda run, **_: read.append(run.url) or {})
    (row,) = runs.list_runs(str(out))
    assert "resources" not in row and read == []
    assert runs.list_runs(str(out), resources=True)[0]["resources"] == {} and len(read) == 1


def test_a_running_runs_peaks_so_far_come_from_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    recorded_run(out, "t-live", rows=5, ended=False)
    status = json.loads((out / "t-live" / "status.json").read_text())
    assert status["state"] == "running" and "peak_memory" not in status
    (row,) = runs.list_runs(str(out), resources=True)
    assert row["peak_memory"] == {
        "0": {"node": "n1", "rss_peak": 104 * MIB},
        "1": {"node": "n2", "rss_peak": 104 * MIB},
    }
    assert runs.run_detail(str(out), "t-live")["peak_memory"] == row["peak_memory"]
