"""The pages in a real browser (Debian's chromium, headless, through Playwright), served by a real
`dtrain dashboard`, over runs `dtrain train mnist` made or is making. Screenshots are kept (tmp dir,
and $DTRAIN_TEST_ARTIFACTS when set)."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from .tools import keep_screenshot, metric_lines, start_training, stop_training, wait_until

LONG_RUN_EPOCHS = 60  # far more than a test watches: it is stopped with Ctrl-C
GROWTH_SEEN = 4  # distinct, rising point counts the run page must show while the run trains
# The polylines the charts drew: [chart, series, points it was given, coordinates it holds].
DRAWN_JS = """() => [...document.querySelectorAll('figure.chart')].flatMap(f =>
    [...f.querySelectorAll('polyline.raw')].map(p => [f.id, p.dataset.series, +p.dataset.points,
        p.getAttribute('points').trim().split(/\\s+/).length]))"""


def drawn(page) -> dict[tuple[str, str], int]:
    """(chart, series) -> the number of points drawn, after checking each polyline holds as many
    coordinates as points it says it was given."""
    out = {}
    for chart, series, points, coords in page.evaluate(DRAWN_JS):
        assert points == coords, (chart, series, points, coords)
        out[(chart, series)] = coords
    return out


def expected(lines: list[dict]) -> dict[tuple[str, str], int]:
    """What a run page must draw for these metrics.jsonl lines (a series only once it has a point)."""
    counts = {
        ("chart-loss", "loss"): sum("loss" in r for r in lines),
        ("chart-loss", "eval loss"): sum("eval_loss" in r for r in lines),
        ("chart-quality", "accuracy"): sum("eval_accuracy" in r for r in lines),
        ("chart-lr", "lr"): sum("lr" in r for r in lines),
        ("chart-throughput", "samples_per_s"): sum("samples_per_s" in r for r in lines),
    }
    return {k: v for k, v in counts.items() if v}


def points_per_line(counts: dict[tuple[str, str], int]) -> int:
    """Every MNIST metrics line is a training line (loss) or an evaluation (accuracy): one point each."""
    return counts.get(("chart-loss", "loss"), 0) + counts.get(("chart-quality", "accuracy"), 0)


def running_run(out: Path, job, min_lines: int) -> Path:
    """The run `job` is training, once it is running and has `min_lines` metrics lines."""

    def ready() -> Path | None:
        for run in out.iterdir() if out.exists() else []:
            status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
            running = status.get("state") == "running" and (run / "metrics.jsonl").exists()
            if running and len(metric_lines(run)) >= min_lines:
                return run
        assert job.poll() is None, job.stdout.read()
        return None

    return wait_until(ready, 300, "the run to train", poll=0.5)


def test_runs_page_lists_a_finished_and_a_running_run(
    dashboard, page, finished_runs: Path, mnist_data: Path, tmp_path: Path
) -> None:
    out = shutil.copytree(finished_runs, tmp_path / "runs")
    finished = sorted(p.name for p in out.iterdir())
    job = start_training(mnist_data, out, LONG_RUN_EPOCHS, tmp_path)
    try:
        running = running_run(out, job, 1).name
        server = dashboard(out)
        page.goto(server.url + "/")
        rows = page.locator("#runs-table tbody tr")
        shown = {tr.get_attribute("data-run"): tr.get_attribute("data-status") for tr in rows.all()}
        assert shown == {**dict.fromkeys(finished, "completed"), running: "running"}
        # Newest first by default (the running run started last); the filter keeps one status.
        assert rows.first.get_attribute("data-run") == running
        page.select_option("select[name=status]", "completed")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**status=completed**")
        assert sorted(r.get_attribute("data-run") for r in rows.all()) == finished
        # Sorted by run id, ascending, with the filter kept.
        page.click("#runs-table th a:text-is('run')")
        page.wait_for_url("**sort=run**")
        page.click("#runs-table th a:has-text('run')")
        page.wait_for_url("**desc=false**")
        assert "status=completed" in page.url
        assert [r.get_attribute("data-run") for r in rows.all()] == finished
        keep_screenshot(page, tmp_path, "runs-page")
    finally:
        stop_training(job)


def test_run_page_draws_a_point_per_metrics_line_and_grows_while_the_run_trains(
    dashboard, page, mnist_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "runs"
    job = start_training(mnist_data, out, LONG_RUN_EPOCHS, tmp_path)
    try:
        run = running_run(out, job, 2)
        server = dashboard(out)
        page.goto(f"{server.url}/runs/{run.name}")
        assert page.locator("#run-status").inner_text() == "running"
        seen: list[int] = []
        deadline = time.monotonic() + 300
        while len(set(seen)) < GROWTH_SEEN and time.monotonic() < deadline:
            assert job.poll() is None, "the run ended before the page was seen to grow"
            seen.append(points_per_line(drawn(page)))
            time.sleep(0.5)
        assert len(set(seen)) >= GROWTH_SEEN and seen == sorted(seen), seen
        assert page.locator("#live").is_visible()
    finally:
        stop_training(job)
    # Stopped (Ctrl-C): the page says so, stops following, and draws exactly what the file holds.
    page.wait_for_function("document.getElementById('run-status').textContent === 'interrupted'", timeout=60_000)
    page.wait_for_function("document.getElementById('live').hidden", timeout=60_000)
    lines = metric_lines(run)
    counts = drawn(page)
    assert counts == expected(lines) and points_per_line(counts) == len(lines) > seen[0]
    events = page.locator("#events-table tbody tr td:nth-child(3)").all_inner_texts()
    assert events[0] == "started" and events[-1] == "interrupted", events
    keep_screenshot(page, tmp_path, "run-page-live")


def test_finished_run_page_charts_events_checkpoints_and_config(
    dashboard, page, finished_runs: Path, tmp_path: Path
) -> None:
    out = shutil.copytree(finished_runs, tmp_path / "runs")
    run = out / sorted(p.name for p in out.iterdir())[0]
    # A torn line in the middle of metrics.jsonl: left out, and the page says which.
    text = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*text[:4], '{"step": 5, "lo', *text[4:]]) + "\n")
    lines = metric_lines_ignoring_bad(run)
    server = dashboard(out)
    page.goto(f"{server.url}/runs/{run.name}")
    counts = drawn(page)
    assert counts == expected(lines) and points_per_line(counts) == len(lines)
    assert page.locator("#skipped").inner_text().startswith("1 line(s) of metrics.jsonl are not JSON")
    assert page.locator("#skipped").inner_text().endswith("line 5")
    # Smoothing draws a second line over the training loss; at 0 there is none.
    assert page.locator("#chart-loss polyline.smooth").count() == 1
    page.eval_on_selector("#smoothing", "s => { s.value = '0'; s.dispatchEvent(new Event('input')); }")
    assert page.locator("#chart-loss polyline.smooth").count() == 0
    assert drawn(page) == counts
    events = [json.loads(ln)["event"] for ln in (run / "events.jsonl").read_text().splitlines()]
    assert page.locator("#events-table tbody tr td:nth-child(3)").all_inner_texts() == events
    steps = page.locator("#checkpoints-table tbody tr td:first-child").all_inner_texts()
    assert steps == sorted(p.name.split("-")[1].lstrip("0") for p in (run / "checkpoints").glob("step-*"))
    config = json.loads((run / "config.json").read_text())["config"]
    assert page.locator("table.config th:text-is('batch_size') + td").inner_text() == str(config["batch_size"])
    page.wait_for_function("!document.getElementById('logs-note').hidden", timeout=60_000)  # no node logs
    keep_screenshot(page, tmp_path, "run-page-finished")


def test_compare_overlays_the_runs_ticked_on_the_runs_page(
    dashboard, page, finished_runs: Path, tmp_path: Path
) -> None:
    server = dashboard(finished_runs)
    ids = sorted(p.name for p in finished_runs.iterdir())
    page.goto(server.url + "/")
    for run_id in ids:
        page.check(f"input[name=run][value='{run_id}']")
    page.click("#compare-form button[type=submit]")
    page.wait_for_url("**/compare?**")
    counts = drawn(page)
    for run_id in ids:
        lines = metric_lines(finished_runs / run_id)
        assert counts[("chart-loss", f"{run_id} loss")] == sum("loss" in r for r in lines)
        assert counts[("chart-quality", run_id)] == sum("eval_accuracy" in r for r in lines)
        assert counts[("chart-lr", run_id)] == sum("lr" in r for r in lines)
    assert len(counts) == 5 * len(ids)  # loss, eval loss, accuracy, lr, throughput per run
    keep_screenshot(page, tmp_path, "compare-page")


def test_cluster_page_shows_this_machine_and_says_it_has_no_queue(
    dashboard, page, finished_runs: Path, tmp_path: Path
) -> None:
    server = dashboard(finished_runs)
    page.goto(server.url + "/cluster")
    row = page.locator("#nodes-table > tbody > tr[data-node=local]")
    assert row.locator("td").nth(3).inner_text().startswith("up")
    assert re.fullmatch(r"\d+(\.\d)?% of \d+", row.locator("td").nth(4).inner_text())
    assert re.fullmatch(r"\d+(\.\d)? / \d+(\.\d)? GiB", row.locator("td").nth(6).inner_text())
    gpus = row.locator("td").nth(7).inner_text()
    if shutil.which("nvidia-smi") is None:
        assert gpus.startswith("no GPU (CPU only")
    assert page.locator("#queue").inner_text().startswith("Job queue\n\nThis cluster has no Slurm: runs start with")
    keep_screenshot(page, tmp_path, "cluster-page")


def metric_lines_ignoring_bad(run: Path) -> list[dict]:
    out = []
    for ln in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            continue
    return out
