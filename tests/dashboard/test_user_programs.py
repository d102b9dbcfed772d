"""A user's own program's run (`dtrain train fit.py`, metrics logged with dtrain's SDK) on a real `dtrain
dashboard`: the REST API through real HTTP (httpx), the pages over HTTP and in a real browser, and `dtrain
plot`. Every number asserted is what the script logged."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import httpx
import pytest
from runs import cli

from .test_pages import drawn
from .tools import dashboard_env, keep_screenshot, metric_lines

STEPS, EVAL_EVERY = 30, 10
ARGS = ["--seed", "3"]  # the script's own (it reads none): what the run page shows it ran with
# A script as users write it: the SDK's log() where it trains, nothing else of dtrain.
FIT = f"""\
import math
from dtrain import sdk

for step in range(1, {STEPS + 1}):
    sdk.log(step, loss=math.exp(-step / 10), lr=0.1 * (1 - step / 40))
    if step % {EVAL_EVERY} == 0:
        sdk.log(step, eval_loss=1.5 * math.exp(-step / 10))
print("done", flush=True)
"""


def logged() -> list[dict]:
    """The rows the script logs (less their time), computed as it does."""
    rows = []
    for step in range(1, STEPS + 1):
        rows.append({"step": step, "loss": math.exp(-step / 10), "lr": 0.1 * (1 - step / 40)})
        if step % EVAL_EVERY == 0:
            rows.append({"step": step, "eval_loss": 1.5 * math.exp(-step / 10)})
    return rows


@dataclasses.dataclass(frozen=True)
class UserRun:
    proj: Path
    out: Path
    run_id: str


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> UserRun:
    proj = tmp_path_factory.mktemp("user-run") / "proj"
    proj.mkdir()
    (proj / "fit.py").write_text(FIT)
    out = proj.parent / "runs"
    r = cli(proj, "train", "fit.py", "--nproc", "1", "--output", str(out), "--", *ARGS)
    assert r.code == 0, r.out + r.err
    assert "done" in r.out
    (run,) = [p.name for p in out.iterdir()]
    assert run.startswith("fit-")
    assert [{k: v for k, v in row.items() if k != "time"} for row in metric_lines(out / run)] == logged()
    return UserRun(proj, out, run)


def without(rows: list[dict], key: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != key} for r in rows]


def test_the_api_lists_the_user_run_and_returns_exactly_the_logged_metrics(dashboard, user_run: UserRun) -> None:
    server = dashboard(user_run.out)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        (row,) = c.get("/api/v1/runs").json()["runs"]
        assert row["run_id"] == user_run.run_id
        assert row["workload"] == "fit" and row["status"] == "completed" and row["exit_code"] == 0
        assert row["world_size"] == 1 and row["last_step"] == STEPS
        evals = [r["eval_loss"] for r in logged() if "eval_loss" in r]
        assert row["best_metric"] == "eval_loss" and row["best_value"] == min(evals)
        assert [r["run_id"] for r in c.get("/api/v1/runs", params={"workload": "fit"}).json()["runs"]] == [
            user_run.run_id
        ]

        metrics = c.get(f"/api/v1/runs/{user_run.run_id}/metrics").json()
        assert without(metrics["rows"], "line") == metric_lines(user_run.out / user_run.run_id)
        assert without(without(metrics["rows"], "line"), "time") == logged()
        assert [r["line"] for r in metrics["rows"]] == list(range(1, len(logged()) + 1))
        assert metrics["skipped"] == {"count": 0, "lines": []}
        since = c.get(f"/api/v1/runs/{user_run.run_id}/metrics", params={"since": 25}).json()["rows"]
        assert [r["step"] for r in since] == [26, 27, 28, 29, 30, 30]

        detail = c.get(f"/api/v1/runs/{user_run.run_id}").json()
        assert detail["config"]["kind"] == "program"
        assert detail["config"]["job"]["program"] == {"kind": "script", "target": "fit.py", "args": ARGS}
        assert detail["status"]["state"] == "completed"


def test_the_pages_render_the_user_run(dashboard, user_run: UserRun) -> None:
    server = dashboard(user_run.out)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        runs_page = c.get("/")
        assert runs_page.status_code == 200
        assert re.findall(r'data-run="([^"]+)"', runs_page.text) == [user_run.run_id]
        page = c.get(f"/runs/{user_run.run_id}")
        assert page.status_code == 200, page.text
        assert f"<h1>{user_run.run_id} " in page.text
        assert "<dt>workload</dt><dd>fit</dd>" in page.text
        # Its config is the job it ran (a built-in's would be the workload's settings).
        assert "<tr><th>script</th><td><code>fit.py --seed 3</code></td></tr>" in page.text
        assert f"<tr><th>workdir</th><td><code>{user_run.proj}</code></td></tr>" in page.text
        # The rows the charts start from are the logged ones.
        embedded = json.loads(re.search(r'<script id="run-data" type="application/json">(.*?)</script>', page.text)[1])
        assert without(without(embedded["metrics"]["rows"], "line"), "time") == logged()
        compare = c.get("/compare", params={"run": user_run.run_id})
        assert compare.status_code == 200 and user_run.run_id in compare.text


def test_the_run_page_draws_the_logged_curves_in_a_browser(dashboard, page, user_run: UserRun, tmp_path: Path) -> None:
    server = dashboard(user_run.out)
    page.goto(f"{server.url}/runs/{user_run.run_id}")
    assert page.locator("#run-status").inner_text() == "completed"
    rows = logged()
    assert drawn(page) == {
        ("chart-loss", "loss"): sum("loss" in r for r in rows),
        ("chart-loss", "eval loss"): sum("eval_loss" in r for r in rows),
        ("chart-lr", "lr"): sum("lr" in r for r in rows),
    }
    assert (
        page.locator("#fact-best").inner_text()
        == f"eval loss {min(r['eval_loss'] for r in rows if 'eval_loss' in r):.4f}"
    )
    keep_screenshot(page, tmp_path, "user-run-page")


def test_dtrain_plot_draws_the_user_run(user_run: UserRun, tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    r = cli(user_run.proj, "plot", user_run.run_id, "--output", str(user_run.out), "-o", str(png),
            env=dashboard_env(tmp_path))  # fmt: skip
    assert r.code == 0, r.out + r.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
