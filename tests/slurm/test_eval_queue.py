"""`dtrain eval RUN --cluster bed --queue` on the real Slurm of the test bed (tests/slurm/conftest.py): the
evaluation is a one-node job in Slurm's queue, listed by `dtrain jobs` as eval:mnist of the run, with its
logs and its cancel, and it writes the same eval/<id>.json under the run as a direct `dtrain eval`. Bad
inputs are one line and leave no record. Needs root, like the other Slurm tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dtrain.common.errors import ExitCode

from .conftest import Env
from .test_slurm_bed import error_line, status

pytestmark = pytest.mark.root


def test_queue_needs_a_cluster_with_slurm(bed: Env, tmp_path: Path) -> None:
    """--queue without a cluster, and on a cluster without Slurm: one line, exit 2, nothing queued and no
    evaluation recorded under the run."""
    run = tmp_path / "mnist-20261124-040000-abcd"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"workload": "mnist", "run_id": run.name}))
    config = tmp_path / "noslurm.toml"
    config.write_text(bed.sb.hosts_toml("plain", sys.executable, nodes=1, slurm=False))
    before = bed.jobs()

    r = bed.dtrain("--config", str(config), "eval", str(run), "--queue")
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert error_line(r) == (
        "error: --queue queues the evaluation as a Slurm job on a cluster: name it with --cluster NAME"
    )
    r = bed.dtrain("--config", str(config), "eval", str(run), "--cluster", "plain", "--queue")
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert error_line(r) == (
        "error: --queue needs a job queue, and cluster 'plain' has none: leave it out to evaluate on its master"
    )
    assert r.stdout == ""
    assert not (run / "eval").exists()
    assert bed.jobs() == before


@pytest.mark.slow
def test_a_queued_eval_is_a_slurm_job_that_writes_the_record(bed: Env) -> None:
    """A finished run is evaluated through the queue: the job id alone on stdout, the job in `dtrain jobs`
    as eval:mnist of the run with its eval id, its logs, and, once COMPLETED, the record under the run
    with the run's own final accuracy. Queued behind a training job that holds both nodes, an evaluation
    waits PENDING and `dtrain cancel` takes it out of the queue."""
    trained = bed.submit("--epochs", "1", "--train-split", "train[:2000]")
    row = bed.wait(trained, lambda j: j["state"] not in ("PENDING", "RUNNING", "COMPLETING"), what="its end")
    assert row["state"] == "COMPLETED", row
    run = Path(row["url"])
    training_log = (run / "logs" / "h0.log").read_text()

    r = bed.dtrain("eval", str(run), "--cluster", "bed", "--queue")
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip()
    assert job.isdigit(), r.stdout
    assert f"job {job} (eval:mnist) queued on cluster bed, partition dtrain: it evaluates run {run.name}" in r.stderr

    listed = bed.jobs()[job]
    assert listed["workload"] == "eval:mnist" and listed["run_id"] == run.name and listed["url"] == str(run), listed
    assert listed["nodes"] == 1 and listed["eval_id"].startswith("eval-"), listed
    done = bed.wait(job, lambda j: j["state"] not in ("PENDING", "RUNNING", "COMPLETING"), what="its end")
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0, done

    record = json.loads((run / "eval" / f"{listed['eval_id']}.json").read_text())
    assert record["id"] == listed["eval_id"] and record["state"] == "completed", record
    assert record["where"] == "bed" and record["model"] == "final" and record["run_id"] == run.name
    assert record["metrics"]["accuracy"] == status(run)["result"]["accuracy"]

    logs = bed.dtrain("logs", job, "--cluster", "bed")
    assert logs.returncode == 0, logs.stderr
    assert f"eval {listed['eval_id']} written to" in logs.stdout, logs.stdout
    assert (run / "logs" / "h0.log").read_text() == training_log  # the run's logs stay its training's
    table = bed.dtrain("jobs", "--cluster", "bed", "--all")
    assert "eval:mnist" in table.stdout, table.stdout

    # The same through login node h2 (a user's Slurm: the nodes Slurm picks, the job's files on the shared disk).
    r = bed.dtrain("eval", str(run), "--cluster", "user", "--queue")
    assert r.returncode == 0, r.stdout + r.stderr
    other = r.stdout.strip()
    done = bed.wait(
        other, lambda j: j["state"] not in ("PENDING", "RUNNING", "COMPLETING"), what="its end", cluster="user"
    )
    assert done["state"] == "COMPLETED" and done["workload"] == "eval:mnist", done
    record = json.loads((run / "eval" / f"{done['eval_id']}.json").read_text())
    assert record["state"] == "completed" and record["where"] == "user", record
    assert record["metrics"]["accuracy"] == status(run)["result"]["accuracy"]
    assert (bed.sb.shared / "user" / "runs" / done["eval_id"] / "logs").is_dir()

    # Behind a training job on both nodes, an evaluation waits; cancel takes it out of the queue.
    busy = bed.submit("--epochs", "20", "--checkpoint-every", "5")
    bed.wait(busy, lambda j: j["state"] == "RUNNING", what="RUNNING")
    r = bed.dtrain("eval", str(run), "--cluster", "bed", "--queue")
    assert r.returncode == 0, r.stdout + r.stderr
    waiting = r.stdout.strip()
    row = bed.jobs()[waiting]
    assert row["state"] == "PENDING" and row["workload"] == "eval:mnist", row
    c = bed.dtrain("cancel", waiting, "--cluster", "bed")
    assert c.returncode == 0, c.stdout + c.stderr
    assert f"job {waiting} CANCELLED (was PENDING); evaluation {row['eval_id']} of run {run.name} stopped" in c.stdout
    assert bed.jobs()[waiting]["state"] == "CANCELLED"
    record = json.loads((run / "eval" / f"{row['eval_id']}.json").read_text())
    assert record["state"] == "failed" and record["error"] == "cancelled (dtrain cancel)", record
    c = bed.dtrain("cancel", busy, "--cluster", "bed")
    assert c.returncode == 0, c.stdout + c.stderr
