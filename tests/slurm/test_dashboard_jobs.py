"""The dashboard's job endpoints on the real Slurm of the test bed (tests/slurm/conftest.py): GET /jobs
lists what `dtrain jobs` lists, POST /jobs queues a workload as `dtrain submit` does, DELETE /jobs/ID
cancels it with its checkpoint kept, and the Cluster page shows the queue. Needs root, like the other
Slurm tests, and the dashboard extra."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from dashboard.tools import start_dashboard

from .conftest import BATCH, TRAIN_IMAGES, Env

pytestmark = [pytest.mark.root, pytest.mark.slow]


def call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_jobs_are_listed_submitted_and_cancelled_through_the_api(bed: Env) -> None:
    server = start_dashboard(bed.cwd, bed.runs, "--cluster", "bed", env=bed.env()).wait_ready()
    try:
        api = f"{server.url}/api/v1"
        settings = {
            "mnist.dataset": "fashion-mnist",
            "mnist.epochs": 20,  # long enough to be running when it is cancelled
            "mnist.train_split": f"train[:{TRAIN_IMAGES}]",
            "mnist.batch_size": BATCH,
            "run.nproc": 1,
            "run.checkpoint_every": 5,
            "run.output": str(bed.runs),
        }
        code, body = call(f"{api}/jobs", "POST", {"workload": "mnist", "settings": settings, "name": "from-api"})
        assert code == 201, body
        job = body["job_id"]
        assert job.isdigit() and body["cluster"] == "bed" and body["nodes"] == 2 and body["workload"] == "mnist"

        # What the API lists is what the CLI lists.
        code, listed = call(f"{api}/jobs?all=1")
        assert code == 200 and listed["cluster"] == "bed"
        row = next(j for j in listed["jobs"] if j["job_id"] == job)
        assert row["name"] == "from-api" and row["run_id"] == body["run_id"] and row["url"] == body["url"]
        assert bed.jobs()[job]["run_id"] == body["run_id"]

        # The Cluster page shows the queue with this job in it.
        deadline = time.monotonic() + 300
        while True:
            code, page = call(f"{server.url}/cluster")
            if code == 200 and f'data-job="{job}"' in page and ">RUNNING<" in page:
                break
            assert time.monotonic() < deadline, f"job {job} never showed RUNNING on the Cluster page"
            time.sleep(1)

        # Bad requests are one line each, and queue nothing.
        before = set(bed.jobs())
        code, err = call(f"{api}/jobs", "POST", {"workload": "mnist", "settings": {"mnist.epoch": 1}})
        assert code == 400 and err["detail"].startswith("unknown setting 'mnist.epoch' for mnist"), err
        code, err = call(f"{api}/jobs", "POST", {"workload": "resnet"})
        assert code == 400 and err["detail"].startswith("unknown workload 'resnet'"), err
        code, err = call(f"{api}/jobs", "POST", {"workload": "mnist", "settings": {"mnist.epochs": "many"}})
        assert code == 400 and "mnist.epochs must be" in err["detail"], err
        code, err = call(f"{api}/jobs/abc", "DELETE")
        assert code == 400 and err["detail"] == "bad job id 'abc': Slurm's job ids are numbers", err
        assert set(bed.jobs()) == before

        code, cancelled = call(f"{api}/jobs/{job}", "DELETE")
        assert code == 200, cancelled
        assert cancelled["job_id"] == job and cancelled["was"] == "RUNNING" and cancelled["state"] == "CANCELLED"
        assert bed.jobs()[job]["state"] == "CANCELLED"
        code, err = call(f"{api}/jobs/{job}", "DELETE")
        assert code == 400 and err["detail"].startswith(f"job {job} has already ended (CANCELLED"), err
    finally:
        server.stop()
