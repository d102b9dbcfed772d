"""The REST API through real HTTP (httpx) against a real `dtrain dashboard` process, over two finished
MNIST runs that `dtrain train mnist` made. Every number asserted is read back from the runs' own
files."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from runs import CLI

from dtrain.control.remote import JOB_ENDED

from .tools import STEPS_PER_EPOCH, Server, dashboard_env, metric_lines, start_dashboard

EPOCHS = 2  # of the finished runs
# A cluster run's logs as the launcher writes them: "<ISO-8601 UTC> <line>", one file per node.
NODE_LOGS = {
    "h0": ["2026-01-01T10:00:00.100+00:00 starting", "2026-01-01T10:00:02.000+00:00 epoch 1/2: eval accuracy 0.5",
           f"2026-01-01T10:00:05.000+00:00 {JOB_ENDED} (exit 0)"],
    "h1": ["2026-01-01T10:00:00.200+00:00 worker up", "2026-01-01T10:00:03.000+00:00 worker done",
           f"2026-01-01T10:00:05.100+00:00 {JOB_ENDED} (exit 0)"],
}  # fmt: skip
OUTSIDE = "outside-the-runs-root-7f3a"  # a marker no answer may contain


@dataclasses.dataclass
class Api:
    server: Server
    out: Path
    client: httpx.Client
    cluster_run: str  # the run given node logs
    local_run: str


@pytest.fixture(scope="module")
def api(finished_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    home = tmp_path_factory.mktemp("api")
    out = shutil.copytree(finished_runs, home / "root" / "runs")
    cluster_run, local_run = sorted(p.name for p in out.iterdir())
    (out / cluster_run / "logs").mkdir()
    for node, lines in NODE_LOGS.items():
        (out / cluster_run / "logs" / f"{node}.log").write_text("".join(ln + "\n" for ln in lines))
    # A run-like directory beside the runs root: what a path escaping the root would reach.
    (home / "root" / "outside").mkdir()
    (home / "root" / "outside" / "config.json").write_text(json.dumps({"workload": OUTSIDE}))
    (home / "root" / "outside" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": OUTSIDE}) + "\n")
    server = start_dashboard(home, out, env=dashboard_env(home)).wait_ready()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield Api(server, out, client, cluster_run, local_run)
    assert server.stop() == 0, server.output


def test_runs_lists_both_runs_with_figures_from_their_files(api: Api) -> None:
    rows = api.client.get("/api/v1/runs").json()["runs"]
    assert sorted(r["run_id"] for r in rows) == sorted([api.cluster_run, api.local_run])
    for r in rows:
        lines = metric_lines(api.out / r["run_id"])
        config = json.loads((api.out / r["run_id"] / "config.json").read_text())
        assert r["status"] == "completed" and r["workload"] == "mnist" and r["world_size"] == 1
        assert r["best_metric"] == "eval_accuracy"
        assert r["best_value"] == max(x["eval_accuracy"] for x in lines if "eval_accuracy" in x)
        assert r["last_step"] == EPOCHS * STEPS_PER_EPOCH == max(x["step"] for x in lines)
        assert r["created"] == config["created"] and 0 < r["duration_s"] < 600
        assert r["hosts"] == [os.uname().nodename]


def test_runs_filters_and_sorts(api: Api) -> None:
    def ids(**params: str) -> list[str]:
        answer = api.client.get("/api/v1/runs", params=params)
        assert answer.status_code == 200, answer.text
        return [r["run_id"] for r in answer.json()["runs"]]

    both = sorted([api.cluster_run, api.local_run])
    assert ids(sort="run", desc="false") == both
    assert ids(sort="run", desc="true") == both[::-1]
    assert ids(status="running") == []
    assert sorted(ids(status="completed", workload="mnist")) == both
    assert ids(q=api.local_run[-4:]) == [api.local_run]
    assert api.client.get("/api/v1/runs", params={"sort": "colour"}).status_code == 400


def test_one_run_has_its_config_status_and_checkpoints(api: Api) -> None:
    run = api.out / api.local_run
    detail = api.client.get(f"/api/v1/runs/{api.local_run}").json()
    assert detail["config"] == json.loads((run / "config.json").read_text())
    assert detail["status"] == json.loads((run / "status.json").read_text())
    # A checkpoint at each epoch's end; the last one is what LATEST names.
    steps = [c["step"] for c in detail["checkpoints"]]
    assert steps == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    assert [c["latest"] for c in detail["checkpoints"]] == [False, True]
    assert all(c["complete"] and c["bytes"] > 0 for c in detail["checkpoints"])
    assert (run / "checkpoints" / "LATEST").read_text().strip() == detail["checkpoints"][-1]["name"]
    assert api.client.get(f"/api/v1/runs/{api.local_run}/checkpoints").json()["checkpoints"] == detail["checkpoints"]


def test_metrics_whole_since_a_step_and_after_a_line(api: Api) -> None:
    lines = metric_lines(api.out / api.local_run)
    url = f"/api/v1/runs/{api.local_run}/metrics"
    whole = api.client.get(url).json()
    assert [{k: v for k, v in r.items() if k != "line"} for r in whole["rows"]] == lines
    assert [r["line"] for r in whole["rows"]] == list(range(1, len(lines) + 1))
    assert whole["lines"] == len(lines) and whole["skipped"] == {"count": 0, "lines": []}
    since = STEPS_PER_EPOCH + 3
    assert [r["step"] for r in api.client.get(url, params={"since": since}).json()["rows"]] == [
        r["step"] for r in lines if r["step"] > since
    ]
    tail = api.client.get(url, params={"after_line": len(lines) - 3}).json()
    assert [r["line"] for r in tail["rows"]] == [len(lines) - 2, len(lines) - 1, len(lines)]


def test_events_are_the_runs_events_jsonl(api: Api) -> None:
    run = api.out / api.local_run
    written = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    got = api.client.get(f"/api/v1/runs/{api.local_run}/events").json()["rows"]
    assert [{k: v for k, v in e.items() if k != "line"} for e in got] == written
    kinds = [e["event"] for e in got]
    assert kinds[0] == "started" and kinds[-1] == "completed"
    assert [e["step"] for e in got if e["event"] == "checkpoint"] == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]


def test_node_logs_in_time_order_a_tail_and_followed(api: Api) -> None:
    url = f"/api/v1/runs/{api.cluster_run}/logs"
    merged = sorted((ln.split(" ", 1)[0], node, ln.split(" ", 1)[1]) for node, lns in NODE_LOGS.items() for ln in lns)
    got = api.client.get(url).json()["lines"]
    assert [(x["stamp"], x["node"], x["text"]) for x in got] == merged
    assert [x["text"] for x in api.client.get(url, params={"tail": 2}).json()["lines"]] == [m[2] for m in merged[-2:]]
    assert [x["node"] for x in api.client.get(url, params={"node": "h1"}).json()["lines"]] == ["h1"] * 3
    # follow=1 on an ended run: the tail asked for, then the end of the stream.
    events = sse(api.client, url, params={"follow": 1, "tail": 4})
    assert [e for e, _ in events][-1] == "end"
    streamed = [(x["stamp"], x["node"], x["text"]) for e, d in events if e == "logs" for x in d["lines"]]
    assert streamed == merged[-4:]
    # A run that ran on this machine has none: 404, saying so.
    answer = api.client.get(f"/api/v1/runs/{api.local_run}/logs")
    assert answer.status_code == 404 and "no node logs" in answer.json()["detail"]


def test_stream_of_an_ended_run_sends_its_rows_then_ends(api: Api) -> None:
    lines = metric_lines(api.out / api.local_run)
    events = sse(api.client, f"/api/v1/runs/{api.local_run}/stream", params={"metrics_line": 5})
    kinds = [e for e, _ in events]
    assert kinds == ["metrics", "events", "run", "end"], kinds
    assert [r["line"] for r in events[0][1]["rows"]] == list(range(6, len(lines) + 1))
    assert events[2][1]["summary"]["status"] == "completed" and events[3][1] == {"status": "completed"}


def test_nodes_and_gpus_of_this_machine(api: Api) -> None:
    (node,) = api.client.get("/api/v1/nodes").json()["nodes"]
    meminfo = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
    assert node["name"] == "local" and node["reachable"] and node["role"] == "master"
    assert node["cpus"] == int(subprocess.run(["nproc"], capture_output=True, text=True).stdout)
    assert node["mem_total_mib"] == int(meminfo["MemTotal"].split()[0]) // 1024
    assert 0 < node["mem_used_mib"] < node["mem_total_mib"] and 0 <= node["cpu_percent"] <= 100
    # The same answer as `dtrain gpus --json`, this machine's GPUs or why it has none.
    cli = subprocess.run([*CLI, "gpus", "--json"], cwd=api.out.parent, env=dashboard_env(api.out.parent),
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    gpus = api.client.get("/api/v1/gpus").json()["gpus"]
    assert set(gpus) == {"local"} and node["cpu_only"] == isinstance(gpus["local"], str)
    if node["cpu_only"]:
        assert gpus == json.loads(cli.stdout) and node["gpus"] == gpus["local"]
        assert node["gpus"].startswith("no GPU (CPU only")
    else:  # utilisation and temperature move between two readings; what a GPU is does not
        fixed = ("index", "name", "total_mib", "driver")
        assert (
            [{k: g[k] for k in fixed} for g in gpus["local"]]
            == [{k: g[k] for k in fixed} for g in json.loads(cli.stdout)["local"]]
            == [{k: g[k] for k in fixed} for g in node["gpus"]]
        )


def test_an_eval_started_over_the_api_gives_the_runs_own_accuracy(api: Api) -> None:
    """POST /evals runs what `dtrain eval` runs (dtrain.control.evals), in the background; GET /evals/{id}
    follows it to its record, whose accuracy is the run's own final eval accuracy."""
    c = api.client
    started = c.post("/api/v1/evals", json={"run": api.local_run})
    assert started.status_code == 202, started.text
    eval_id = started.json()["id"]
    assert started.json()["run"] == api.local_run and started.json()["state"] == "pending"
    deadline = time.monotonic() + 600
    while (record := c.get(f"/api/v1/evals/{eval_id}").json()).get("state") in ("pending", "running"):
        assert time.monotonic() < deadline, record
        time.sleep(0.5)
    assert record["state"] == "completed", record
    final = json.loads((api.out / api.local_run / "status.json").read_text())["result"]
    assert record["metrics"]["accuracy"] == final["accuracy"], (record, final)
    # Found by its id alone, and in the run's eval/ folder, as `dtrain eval` leaves it.
    assert c.get(f"/api/v1/evals/{eval_id}", params={"run": api.local_run}).json() == record
    assert (api.out / api.local_run / "eval" / f"{eval_id}.json").is_file()
    bad = c.get("/api/v1/evals/..%2F..%2Fconfig")
    assert bad.status_code in (400, 404) and OUTSIDE not in bad.text
    assert c.post("/api/v1/evals", json={"run": "no-such-run"}).status_code == 404


def test_jobs_on_a_cluster_without_slurm_are_one_line_400s(api: Api) -> None:
    """This machine has no job queue: each job endpoint says so (tests/slurm/test_dashboard_jobs.py drives them
    on a real Slurm)."""
    c = api.client
    no_slurm = "this machine lacks a job queue: jobs queue on Slurm clusters"
    for answer, detail in [
        (c.get("/api/v1/jobs"), no_slurm),
        (c.post("/api/v1/jobs", json={"workload": "mnist", "settings": {"mnist.epochs": 1}}), no_slurm),
        (c.delete("/api/v1/jobs/7"), no_slurm),
        (c.post("/api/v1/jobs", json={"workload": "mnist", "settings": {"run.nprocs": 2}}), "unknown setting"),
        (c.post("/api/v1/jobs", json={}), ""),  # no workload: FastAPI's validation answer
    ]:
        if detail:
            assert answer.status_code == 400 and answer.json()["detail"].startswith(detail), answer.text
        else:
            assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "workload"]


def test_openapi_page_and_schema_are_served_without_a_cdn(api: Api) -> None:
    docs = api.client.get("/docs")
    assert docs.status_code == 200 and "/static/docs/swagger-ui-bundle.js" in docs.text
    assert "cdn" not in docs.text.lower() and "https://" not in docs.text
    assert api.client.get("/static/docs/swagger-ui-bundle.js").status_code == 200
    paths = set(api.client.get("/api/v1/openapi.json").json()["paths"])
    wanted = ["/runs", "/runs/{run_id}", "/runs/{run_id}/metrics", "/runs/{run_id}/logs", "/runs/{run_id}/events",
              "/nodes", "/gpus", "/evals", "/evals/{eval_id}", "/jobs", "/jobs/{job_id}"]  # fmt: skip
    assert {f"/api/v1{p}" for p in wanted} <= paths


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/runs/..",
        "/api/v1/runs/%2e%2e",
        "/api/v1/runs/..%2Foutside",
        "/api/v1/runs/..%2foutside/metrics",
        "/api/v1/runs/%2E%2E%2Foutside/events",
        "/api/v1/runs/..%5Coutside",
        "/api/v1/runs/outside%00",
        "/runs/..%2Foutside",
        "/compare?run=..%2Foutside",
    ],
)
def test_a_path_outside_the_runs_root_is_refused(api: Api, path: str) -> None:
    answer = api.client.get(path)
    assert answer.status_code in (400, 404), (answer.status_code, answer.text)
    assert OUTSIDE not in answer.text


def test_dot_segments_sent_raw_are_refused(api: Api) -> None:
    """httpx would normalise `/../`; a raw request line keeps it."""
    host, port = api.server.url.removeprefix("http://").split(":")
    for target in ("/api/v1/runs/../outside", "/api/v1/runs/../../root/outside/metrics", "/runs/../outside"):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            reply = b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace")
        status = int(reply.split(" ", 2)[1])
        assert status in (400, 404), reply
        assert OUTSIDE not in reply


def test_a_local_bind_answers_to_localhost_names_only(api: Api) -> None:
    port = api.server.url.rsplit(":", 1)[1]
    assert api.client.get("/api/v1/runs", headers={"Host": f"localhost:{port}"}).status_code == 200
    rebound = api.client.get("/api/v1/runs", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421 and "localhost only" in rebound.json()["detail"]
    # A page of another origin may not make the browser change anything (POST carries Origin).
    cross = api.client.post("/api/v1/evals", json={}, headers={"Origin": "http://attacker.example"})
    assert cross.status_code == 403


def sse(client: httpx.Client, url: str, params: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent event stream, read until the server closes it."""
    out = []
    with client.stream("GET", url, params=params) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        event, data = "", ""
        for line in answer.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
            elif not line and event:
                out.append((event, json.loads(data)))
                event, data = "", ""
    return out
