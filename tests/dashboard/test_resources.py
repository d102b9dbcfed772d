"""Resource curves on the dashboard: a real `dtrain dashboard` over a run folder whose resources/ and status.json
the recorder wrote from real samples of this machine (dtrain.common.resources, as a launcher does), read through
real HTTP and drawn in a real browser: one inline SVG chart a node, and each rank's peak memory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from memory_holders import MIB, hold

from dtrain.common import resources, runrecord
from dtrain.common.storage import open_store


def sampled_run(out: Path, name: str, samples: int = 6) -> Path:
    """A completed run with `samples` rows for node "n1" (this machine, a 24 MiB rank 0 in its tree)."""
    run = out / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"workload": "t", "created": time.time() - 60, "world_size": 1}))
    store = open_store(str(run))
    runrecord.record_start(store, starts=1, host="h0")
    rank = hold(24, RANK="0")
    try:
        sampler, rec = resources.Sampler(gpus=False), resources.Recorder(store)
        for _ in range(samples):
            time.sleep(0.05)
            rec.add("n1", sampler.sample([rank.pid]))
        rec.close()
    finally:
        rank.kill()
        rank.wait()
    runrecord.record_end(store, 0)
    return run


def test_the_run_page_draws_each_nodes_curves_and_lists_each_ranks_peak(dashboard, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "runs"
    sampled_run(out, "t-curves")
    plain = out / "t-none"  # a run from before resource curves
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"workload": "t", "created": time.time()}))
    (plain / "status.json").write_text(json.dumps({"state": "completed", "exit_code": 0, "updated": time.time()}))
    server = dashboard(out)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        detail = client.get("/api/v1/runs/t-curves").json()
        series = detail["resources"]["n1"]
        assert len(series["time"]) == 6 and series["time"] == sorted(series["time"])
        peak = detail["status"]["peak_memory"]["0"]
        assert peak["node"] == "n1" and peak["rss_peak"] >= 24 * MIB
        assert detail["summary"]["peak_memory"] == detail["status"]["peak_memory"]

        html = client.get("/runs/t-curves").text
        charts = re.findall(r'<figure class="resource-curve" data-node="([^"]+)">', html)
        assert charts == ["n1"]
        for kind in ("cpu", "mem"):
            (points,) = re.findall(rf'<polyline class="curve-{kind}" points="([^"]*)"', html)
            xy = [tuple(map(float, p.split(","))) for p in points.split()]
            assert len(xy) == 6 and xy[0][0] == 0.0 and xy[-1][0] == 480.0  # the run's span, the chart's width
            assert all(0.0 <= y <= 120.0 for _, y in xy)
        assert "6 samples over" in html
        (row,) = re.findall(r'<table class="peaks" id="peaks-table">.*?<tbody>(.*?)</tbody>', html, re.S)
        cells = re.findall(r"<td[^>]*>([^<]*)</td>", row)
        assert cells[:2] == ["0", "n1"] and cells[2].endswith(" MiB") and int(cells[2][:-4].replace(",", "")) >= 24

        none = client.get("/runs/t-none").text
        assert '<p class="empty" id="resources-empty">No resource samples recorded.</p>' in none
        assert "<svg" not in none


def test_the_curves_render_in_a_browser(dashboard, page, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "runs"
    sampled_run(out, "t-browser", samples=3)
    server = dashboard(out)
    page.goto(f"{server.url}/runs/t-browser")
    chart = page.locator("figure.resource-curve[data-node=n1] svg")
    box = chart.bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 50
    cpu = page.locator("svg polyline.curve-cpu")
    assert cpu.evaluate("e => e.points.numberOfItems") == 3
    assert page.locator("#peaks-table tbody tr").count() == 1
