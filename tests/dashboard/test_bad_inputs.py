"""Bad inputs to the dashboard, each answered in one line: an unknown run (HTTP 404 saying which), a
port already in use and a gs:// output without credentials (`dtrain dashboard` exits 2 with one
error line), a corrupt metrics line (skipped and reported, never fatal)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
from runs import cli

from .tools import dashboard_env, metric_lines


def test_an_unknown_run_is_a_404_naming_it(dashboard, finished_runs: Path) -> None:
    server = dashboard(finished_runs)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path in ("/api/v1/runs/mnist-20000101-000000-dead", "/api/v1/runs/mnist-20000101-000000-dead/metrics"):
            answer = c.get(path)
            assert answer.status_code == 404
            assert answer.json() == {
                "detail": f"no run 'mnist-20000101-000000-dead' under {finished_runs} (`dtrain runs` lists them)"
            }
        page = c.get("/runs/mnist-20000101-000000-dead")
        assert page.status_code == 404 and "no run &#39;mnist-20000101-000000-dead&#39; under" in page.text


def test_a_port_in_use_is_one_line(finished_runs: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = cli(tmp_path, "dashboard", "--output", str(finished_runs), "--port", str(port), env=dashboard_env(tmp_path))
    assert r.code == 2, r.out + r.err
    assert r.error_line() == f"error: port {port} on 127.0.0.1 is already in use (another dashboard?): pass --port N"


def test_a_bucket_without_credentials_is_one_line(tmp_path: Path) -> None:
    env = dashboard_env(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "no-such-key.json"))
    env.pop("STORAGE_EMULATOR_HOST", None)
    r = cli(tmp_path, "dashboard", "--output", "gs://dtrain-no-such-bucket/runs", "--port", "0", env=env)
    assert r.code == 2, r.out + r.err
    assert r.error_line() == (
        "error: no Google Cloud credentials found for gs:// storage: run `gcloud auth application-default login` "
        "or set GOOGLE_APPLICATION_CREDENTIALS to a key file"
    )


def test_a_corrupt_metrics_line_is_skipped_and_reported(dashboard, finished_runs: Path, tmp_path: Path) -> None:
    out = shutil.copytree(finished_runs, tmp_path / "runs")
    run_id = sorted(p.name for p in out.iterdir())[0]
    metrics = out / run_id / "metrics.jsonl"
    good = metric_lines(out / run_id)
    lines = metrics.read_text().splitlines()
    lines[2:2] = ['{"step": 3, "loss": 2.3', "not json at all"]  # a torn write and garbage: lines 3 and 4
    metrics.write_text("\n".join(lines) + "\n")
    server = dashboard(out)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        page = c.get(f"/api/v1/runs/{run_id}/metrics").json()
        assert page["skipped"] == {"count": 2, "lines": [3, 4]}
        assert [{k: v for k, v in r.items() if k != "line"} for r in page["rows"]] == good
        assert page["lines"] == len(good) + 2
        (row,) = [r for r in c.get("/api/v1/runs").json()["runs"] if r["run_id"] == run_id]
        assert row["skipped_metric_lines"] == 2 and row["best_value"] == max(
            r["eval_accuracy"] for r in good if "eval_accuracy" in r
        )
        assert c.get(f"/runs/{run_id}").status_code == 200 and c.get("/").status_code == 200
    assert json.loads(lines[0])["step"] == good[0]["step"]  # the file itself is left as it was
