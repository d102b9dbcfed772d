"""Stragglers and hung ranks in the dashboard: a real `dtrain dashboard` over run folders whose events.jsonl
the test writes as the launcher does (dtrain.common.metrics.record_event, what remote.py's _on_alive and
_on_hang call), read through real HTTP and in a real browser."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from dtrain.common.metrics import record_event
from dtrain.common.storage import open_store
from dtrain.control import runs

from .tools import keep_screenshot, wait_until

SLOW = {"h1 rank 1": 2.31}
STACK = 'Thread 0x00007f (most recent call first):\n  File "/w/train.py", line 42 in all_reduce_grads\n'


def make_run(out: Path, name: str, state: str = "running", started: float = 0.0) -> Path:
    """A cluster run's folder: "running" on another host (so no local process is looked for)."""
    run = out / name
    run.mkdir(parents=True)
    config = {"workload": "mnist", "created": started or time.time() - 60, "world_size": 4}
    (run / "config.json").write_text(json.dumps(config))
    (run / "status.json").write_text(json.dumps({"state": state, "host": "h0", "pid": 1, "updated": time.time()}))
    record_event(open_store(str(run)), 0, "started", "started on 4 process(es)", world_size=4)
    return run


def straggler(run: Path, found: dict[str, float]) -> None:
    text = ", ".join(f"{k} ({x:.1f}x the others' median step)" for k, x in sorted(found.items()))
    message = f"dtrain: straggler: {text}" if found else "dtrain: no straggler any more"
    record_event(open_store(str(run)), None, "straggler", message, stragglers=found)


def hang(run: Path) -> None:
    """What the launcher does when a node's agent reports a hung rank: the stacks first, then the event."""
    (run / "hangs").mkdir(exist_ok=True)
    (run / "hangs" / "h1-rank1.txt").write_text(STACK)
    line = f"dtrain: hang on h1 rank 1: no progress for 41 s since step 120; stacks in {run}/hangs/h1-rank1.txt"
    record_event(open_store(str(run)), 120, "hang", line, node="h1", rank=1, age_s=41.2, timeout_s=40)


def test_api_and_pages_show_a_running_runs_stragglers_and_its_hung_ranks(dashboard, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    slow = make_run(out, "mnist-c-slow", started=time.time() - 30)
    straggler(slow, SLOW)
    even = make_run(out, "mnist-b-even", started=time.time() - 60)
    straggler(even, SLOW)
    straggler(even, {})  # it had one, and has none any more
    ended = make_run(out, "mnist-a-ended", "completed", started=time.time() - 90)
    straggler(ended, SLOW)  # its last row still names one, but the run is over
    hang(ended)
    server = dashboard(out)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        rows = {r["run_id"]: r["stragglers"] for r in client.get("/api/v1/runs").json()["runs"]}
        assert rows == {"mnist-c-slow": SLOW, "mnist-b-even": {}, "mnist-a-ended": {}}
        found = client.get("/api/v1/runs", params={"q": "straggler"}).json()["runs"]
        assert [r["run_id"] for r in found] == ["mnist-c-slow"]
        assert client.get("/api/v1/runs/mnist-c-slow").json()["summary"]["stragglers"] == SLOW

        runs_page = client.get("/").text
        assert runs_page.count("straggler: h1 rank 1 (2.3x)") == 1
        run_page = client.get("/runs/mnist-c-slow").text
        assert '<dd id="fact-stragglers" class="straggler">h1 rank 1 (2.3x)</dd>' in run_page
        assert '<dd id="fact-stragglers" class="">none</dd>' in client.get("/runs/mnist-b-even").text
        assert '<dd id="fact-stragglers" class="">-</dd>' in client.get("/runs/mnist-a-ended").text

        # The hung ranks' stacks: in the API and on the run page, beside the hang event.
        assert client.get("/api/v1/runs/mnist-a-ended/hangs").json() == {
            "hangs": [{"name": "h1-rank1.txt", "text": STACK, "bytes": len(STACK)}]
        }
        assert client.get("/api/v1/runs/mnist-c-slow/hangs").json() == {"hangs": []}
        ended_page = client.get("/runs/mnist-a-ended").text
        assert '<tr class="event-hang">' in ended_page and "line 42 in all_reduce_grads" in ended_page
        assert '<section id="hangs" hidden>' in client.get("/runs/mnist-c-slow").text
        assert client.get("/api/v1/runs/a..b/hangs").status_code == 400
        assert client.get("/api/v1/runs/..%2Fruns%2Fmnist-a-ended/hangs").status_code in (400, 404)
        assert client.get("/api/v1/runs/no-such-run/hangs").status_code == 404

        straggler(slow, {})  # the launcher: none any more
        assert client.get("/api/v1/runs/mnist-c-slow").json()["summary"]["stragglers"] == {}
        assert "straggler: h1" not in client.get("/").text


def test_the_run_page_follows_stragglers_and_shows_a_hangs_stacks(dashboard, page, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    run = make_run(out, "mnist-live")
    straggler(run, SLOW)
    server = dashboard(out)
    page.goto(f"{server.url}/runs/mnist-live")
    fact = page.locator("#fact-stragglers")
    assert fact.inner_text() == "h1 rank 1 (2.3x)"
    assert page.locator("#events-table tbody tr.event-straggler").count() == 1
    assert page.locator("#hangs").is_hidden()

    # A second straggler: the stream brings the event and the run's new row; slowest first, each ratio written
    # as the launcher's message and the server write it (exact halves go to the even tenth, as Python's do).
    found = {"h0 rank 2": 1.75, "h1 rank 1": 2.25, "h2 rank 0": 1.64}
    straggler(run, found)
    want = runs.stragglers_label(found)
    assert want == "h1 rank 1 (2.2x), h0 rank 2 (1.8x), h2 rank 0 (1.6x)"
    page.wait_for_function(f"document.getElementById('fact-stragglers').textContent === {want!r}", timeout=15_000)
    assert page.locator("#events-table tbody tr.event-straggler").count() == 2

    # A hang: its row, the stuck rank's stacks, and no straggler any more (the job is being stopped).
    hang(run)
    page.locator("#hangs pre").wait_for(timeout=15_000)
    assert "line 42 in all_reduce_grads" in page.locator("#hangs pre").inner_text()
    assert page.locator("#hangs summary").inner_text() == "hangs/h1-rank1.txt"
    assert (
        page.locator("#events-table tbody tr.event-hang td:nth-child(4)")
        .inner_text()
        .startswith("dtrain: hang on h1 rank 1")
    )
    wait_until(lambda: fact.inner_text() == "none", 15, "the straggler to be cleared by the hang")
    keep_screenshot(page, tmp_path, "run-page-stragglers-hang")
