"""The dashboard's node logs for a real cluster run on the multi-host test bed (two network namespaces
with their own sshd; the run in a bucket of the emulator inside h0): each node's lines are served by
`GET /api/v1/runs/{id}/logs` within 10 s of the launcher receiving them, while the job runs, and
`?follow=1` streams them to the job's end. Real CLI, OpenSSH, torchrun, gloo and uvicorn; no mocks.

Needs root (CI runs as root) and Debian's Fashion-MNIST files, as test_launch.py, whose fixtures
(the cluster `bed` in a dtrain.toml, the emulator) it uses."""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from dtrain.common.rundir import read_json
from dtrain.common.storage import open_store
from dtrain.control.remote import JOB_ENDED

from .bed import Testbed
from .test_launch import MNIST, bucket, cwd, emulator, start, wait_for_value  # noqa: F401 - fixtures

pytestmark = [pytest.mark.root, pytest.mark.slow]  # a 2-host test bed and a 3-epoch run: minutes
LOG_BOUND_S = 10.0
POLL_S = 0.25


def test_the_dashboard_serves_node_logs_within_10_s(cwd: Path, emulator: str, testbed: Testbed) -> None:  # noqa: F811
    out = bucket(emulator)
    args = [*MNIST[: MNIST.index("--epochs")], "--epochs", "3", "--train-split", "train[:4096]",
            "--batch-size", "256", "--nproc", "1", "--output", out]  # fmt: skip
    job = start(cwd, emulator, *args)
    server = start(cwd, emulator, "dashboard", "--output", out, "--port", "0")
    printed: list[str] = []
    threading.Thread(target=lambda: [printed.append(ln) for ln in server.stdout], daemon=True).start()
    try:
        url = wait_for_value(
            lambda: (m := re.search(r"dashboard: (http://\S+/)", "".join(printed))) and m[1], server, 120
        )
        store = open_store(out)
        run_id = wait_for_value(lambda: next(iter({n.split("/")[0] for n in store.list("")}), None), job, 120)
        created = wait_for_value(lambda: (read_json(store.child(run_id), "config.json") or {}).get("created"), job, 120)
        lags: dict[tuple[str, str], float] = {}  # (node, line) -> seconds from received to served
        with httpx.Client(base_url=url, timeout=60) as c:
            while job.poll() is None:
                answer = c.get(f"/api/v1/runs/{run_id}/logs", params={"tail": 0})
                now = datetime.datetime.now(datetime.timezone.utc).timestamp()
                for ln in answer.json().get("lines", []) if answer.status_code == 200 else []:
                    # A line from before the run existed counts from the run's creation.
                    received = max(datetime.datetime.fromisoformat(ln["stamp"]).timestamp(), created)
                    lags.setdefault((ln["node"], ln["text"]), now - received)
                time.sleep(POLL_S)
            assert job.returncode == 0, job.stdout.read()
            during = [line for node, line in lags if "eval accuracy" in line and not line.startswith("epoch 3/3")]
            assert during, lags  # epoch 1's and 2's results were served while the job still ran
            assert {node for node, _ in lags} == {"h0", "h1"}
            assert max(lags.values()) <= LOG_BOUND_S, sorted(lags.items(), key=lambda kv: kv[1])[-5:]
            # follow=1 on the ended run: every line, ending with each node's job-ended line, then `end`.
            streamed, ended = [], False
            with c.stream("GET", f"/api/v1/runs/{run_id}/logs", params={"follow": 1, "tail": 0}) as s:
                event = ""
                for line in s.iter_lines():
                    if line.startswith("event: "):
                        event = line[len("event: ") :]
                    elif line.startswith("data: ") and event == "logs":
                        streamed += [(x["node"], x["text"]) for x in json.loads(line[len("data: ") :])["lines"]]
                    ended = ended or event == "end"
            assert ended and sorted(t for _, t in streamed[-2:]) == [f"{JOB_ENDED} (exit 0)"] * 2, streamed[-4:]
            assert {(n, t) for n, t in streamed} >= set(lags)
    finally:
        for p in (job, server):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
