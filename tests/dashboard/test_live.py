"""How fresh the API's metrics are while a real run trains: a metrics line is served within 5 s of
the workload logging it (the "time" it carries) for a run in a local directory, and within 30 s for
one in a bucket (gcp-storage-emulator; a run there appends its lines every 10 s)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from .tools import start_training, stop_training, wait_until

LOCAL_BOUND_S = 5.0
BUCKET_BOUND_S = 30.0
POLL_S = 0.25  # the test's own polling adds at most this to what it measures
LONG_RUN_EPOCHS = 60  # stopped by the test long before it ends


def lags_while_training(url: str, job, *, lines: int, batches: int, timeout: float) -> list[tuple[float, int]]:
    """(seconds from a line's "time" to the API serving it, the poll it came in) for each line served
    while `job` trains, until `lines` lines have come in `batches` separate polls or more. The first
    poll's lines are left out: they are what the run wrote before the measurement began."""
    lags: list[tuple[float, int]] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        run_id = wait_until(lambda: [r["run_id"] for r in c.get("/api/v1/runs").json()["runs"]], 300, "the run")[0]
        after, polls, deadline = 0, 0, time.monotonic() + timeout
        while len(lags) < lines or len({p for _, p in lags}) < batches:
            assert job.poll() is None, f"the run ended before {lines} lines were seen: {job.stdout.read()}"
            assert time.monotonic() < deadline, f"only {len(lags)} lines in {timeout} s: {lags}"
            page = c.get(f"/api/v1/runs/{run_id}/metrics", params={"after_line": after}).json()
            now = time.time()
            polls += 1
            if polls > 1:
                lags += [(now - row["time"], polls) for row in page["rows"] if "time" in row]
            after = page["lines"]
            time.sleep(POLL_S)
    return lags


def test_a_local_runs_lines_are_served_within_5_s(dashboard, mnist_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    job = start_training(mnist_data, out, LONG_RUN_EPOCHS, tmp_path)
    try:
        server = dashboard(out)
        lags = lags_while_training(server.url, job, lines=20, batches=5, timeout=300)
    finally:
        stop_training(job)
    worst = max(lag for lag, _ in lags)
    assert worst < LOCAL_BOUND_S, sorted(lags)[-5:]


@pytest.mark.slow  # a minute or two: a run in the emulator's bucket flushes its lines every 10 s
def test_a_bucket_runs_lines_are_served_within_30_s(dashboard, gcs_bucket: str, mnist_data: Path, tmp_path: Path):
    job = start_training(mnist_data, gcs_bucket, LONG_RUN_EPOCHS, tmp_path)
    try:
        server = dashboard(gcs_bucket)  # its environment has the emulator's address, as the run's has
        # Three flushes seen: lines that waited for one, from a poll after the run had started.
        lags = lags_while_training(server.url, job, lines=10, batches=3, timeout=400)
    finally:
        stop_training(job)
    worst = max(lag for lag, _ in lags)
    assert worst < BUCKET_BOUND_S, sorted(lags)[-5:]
