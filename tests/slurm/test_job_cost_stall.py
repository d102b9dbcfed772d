"""`dtrain jobs`' node-hours, estimated cost and stalled jobs, without a cluster: Slurm's lines parsed by
the real parsing code (lines as Debian 12's slurm-wlm 22.05 prints them), a gcp cluster made from a record
by its backend, and a run directory whose metrics.jsonl the workloads' own Reporter wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.common.errors import UserError
from dtrain.control.backends import get
from dtrain.control.gcp.record import key_path, write_record
from dtrain.control.settings import ClusterConfig
from dtrain.control.slurm import commands
from dtrain.control.slurm.joblist import elapsed_seconds, expand_nodelist, job_row, stall_since
from dtrain.control.slurm.session import JobRecord
from dtrain.control.slurm.spec import STALL_AFTER_S

# g2-standard-8 (one L4), us-central1, on demand (prices.py), a 100 GB pd-balanced disk, Spot at 0.40.
G2, DISK = 0.853624, 100 * 0.10 / 730
ON_DEMAND, SPOT = G2 + DISK, G2 * 0.40 + DISK

RUNNING = (
    "JobId=12 JobName=lr-3e-3 UserId=dtrain(1000) JobState=RUNNING Reason=None Requeue=1 Restarts=0 BatchFlag=1 "
    "ExitCode=0:0 RunTime=02:30:00 TimeLimit=UNLIMITED SubmitTime=2026-11-24T00:40:50 "
    "StartTime=2026-11-24T00:41:01 EndTime=Unknown Partition=dtrain NodeList=demo-worker-[0-1] BatchHost=demo-worker-0 "
    "NumNodes=2 NumCPUs=16 NumTasks=2"
)
# `sacct -c -P -n -o` COMPLETION_FIELDS: ran on the master and a worker for 1 h 15 min.
COMPLETED = "13|lr-1e-3|COMPLETED|0:0|2026-11-24T01:00:00|2026-11-24T02:15:00|2|demo-master,demo-worker-0\n"


def record(job_id: str = "12", nodes: int = 2) -> JobRecord:
    return JobRecord(job_id, "lr", "mnist", "mnist-20261124-004050-abcd", "gs://b/runs/x", "/d", nodes, 0.0, "demo")


@pytest.fixture
def gcp_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A gcp cluster of a master and two L4 Spot workers (the master on-demand), as its backend makes it
    from the record `dtrain up` wrote."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    node = {"external_ip": "34.1.2.3", "gpus": 1, "accelerator": "nvidia-l4", "machine_type": "g2-standard-8"}
    write_record(
        {
            "name": "demo", "backend": "gcp", "project": "proj-123456", "region": "us-central1",
            "zone": "us-central1-a", "bucket": "gs://b", "registry": "r", "ssh_user": "dtrain", "slurm": True,
            "nodes": [
                {**node, "name": "demo-master", "role": "master", "internal_ip": "10.42.0.2"},
                {**node, "name": "demo-worker-0", "role": "worker", "internal_ip": "10.42.0.3"},
                {**node, "name": "demo-worker-1", "role": "worker", "internal_ip": "10.42.0.4"},
            ],
        }
    )  # fmt: skip
    key_path("demo").write_text("key")
    table = {"project": "proj-123456", "workers": 2, "use_gpu": True, "spot": True, "stall_after": "45m"}
    return get("gcp").cluster(ClusterConfig(backend="gcp", name="demo", spec=table))


def test_the_gcp_backend_prices_each_node_and_reads_stall_after(gcp_cluster) -> None:
    prices = gcp_cluster.node_usd_per_hour
    assert prices == {
        "demo-master": pytest.approx(ON_DEMAND),  # master_spot = false: on-demand
        "demo-worker-0": pytest.approx(SPOT),
        "demo-worker-1": pytest.approx(SPOT),
    }
    assert gcp_cluster.slurm.stall_after == 45 * 60


def test_a_running_jobs_node_hours_and_cost(gcp_cluster) -> None:
    state = commands.job_from_scontrol(commands.parse_kv(RUNNING))
    row = job_row(gcp_cluster, record(), state, {}, now=1e9)
    assert row.node_hours == 5.0  # 2 h 30 min x 2 nodes
    assert row.usd == pytest.approx(2.5 * 2 * SPOT) and round(row.usd, 4) == 1.7757
    d = row.as_dict()
    assert (d["node_hours"], d["usd"]) == (5.0, 1.7757)


def test_an_ended_jobs_cost_prices_each_of_its_nodes(gcp_cluster) -> None:
    state = commands.jobs_from_sacct(COMPLETED, completion=True)["13"]
    row = job_row(gcp_cluster, record("13"), state, {}, now=1e9)
    assert row.node_hours == 2.5  # 1 h 15 min (End - Start: the completion file has no Elapsed) x 2 nodes
    assert round(row.usd, 4) == round(1.25 * (ON_DEMAND + SPOT), 4) == 1.5281
    assert not row.stalled  # ended jobs are never stalled


def test_a_pending_job_costs_nothing_yet(gcp_cluster) -> None:
    pending = commands.job_from_scontrol(
        commands.parse_kv(
            "JobId=14 JobName=j JobState=PENDING Reason=Resources RunTime=00:00:00 NumNodes=3 NodeList=(null)"
        )
    )
    row = job_row(gcp_cluster, record("14", 3), pending, {}, now=1e9)
    assert (row.node_hours, row.usd, row.stalled) == (0.0, 0.0, False)


def test_no_price_on_a_users_own_cluster(tmp_path: Path) -> None:
    """backend hosts (and slurm): dtrain knows no price for the user's machines; `dtrain jobs` shows "-"."""
    nodes = [{"name": "h0", "address": "10.0.0.1"}, {"name": "h1", "address": "10.0.0.2"}]
    spec = {"slurm": True, "nodes": nodes}
    c = get("hosts").cluster(ClusterConfig(backend="hosts", name="lab", spec=spec, source=str(tmp_path / "t")))
    assert c.node_usd_per_hour is None and c.slurm.stall_after == STALL_AFTER_S == 1800
    state = commands.job_from_scontrol(commands.parse_kv(RUNNING.replace("demo-worker-[0-1]", "h[0-1]")))
    row = job_row(c, record(), state, {}, now=1e9)
    assert row.node_hours == 5.0 and row.usd is None and row.as_dict()["usd"] is None


# ---------------------------------------------------------------------------------------------
# stalled


def metrics_of_a_run(run: Path, steps: int) -> dict:
    """The workloads' Reporter writes `steps` metrics lines into the run, as rank 0 does; the last line,
    as `dtrain jobs` reads it (its own reader)."""
    from dtrain.common.metrics import Reporter
    from dtrain.common.storage import open_store
    from dtrain.control.slurm.joblist import last_line

    reporter = Reporter(enabled=True, store=open_store(str(run)))
    for step in range(1, steps + 1):
        reporter.log(step, loss=1.0 / step)
    reporter.close()
    return last_line((run / "metrics.jsonl").read_text())


def test_a_running_job_whose_metrics_stopped_is_stalled_since_its_last_line(tmp_path: Path) -> None:
    nodes = [{"name": "h0", "address": "10.0.0.1"}, {"name": "h1", "address": "10.0.0.2"}]
    spec = {"slurm": True, "nodes": nodes, "stall_after": "90s"}
    c = get("hosts").cluster(ClusterConfig(backend="hosts", name="lab", spec=spec, source=str(tmp_path / "t")))
    assert c.slurm.stall_after == 90
    last = metrics_of_a_run(tmp_path / "run", steps=3)
    assert last["step"] == 3
    logged = last["time"]
    state = commands.job_from_scontrol(commands.parse_kv(RUNNING.replace("demo-worker-[0-1]", "h[0-1]")))
    # 89 s after its last line: still running as far as anyone can tell.
    assert not job_row(c, record(), state, last, now=logged + 89).stalled
    row = job_row(c, record(), state, last, now=logged + 90)
    assert row.stalled and row.stalled_since == logged
    assert row.as_dict()["stalled"] is True and row.as_dict()["stalled_since"]
    # A job that has not logged a line since its current start (2 h 30 min ago: requeued, or stuck before
    # its first step) counts from that start.
    assert stall_since(state, {}, stall_after=90, now=1e9) == 1e9 - 9000
    assert stall_since(state, {"time": 1e9 - 20_000}, stall_after=90, now=1e9) == 1e9 - 9000
    young = commands.job_from_scontrol(commands.parse_kv(RUNNING.replace("RunTime=02:30:00", "RunTime=00:01:00")))
    assert stall_since(young, {}, stall_after=90, now=1e9) is None
    # Only a RUNNING job stalls: a pending one waits, an ended one is done.
    pending = commands.job_from_scontrol(commands.parse_kv("JobId=3 JobState=PENDING RunTime=00:00:00 NumNodes=2"))
    assert stall_since(pending, {}, stall_after=90, now=1e9) is None
    assert stall_since(None, {}, stall_after=90, now=1e9) is None


def test_a_run_that_cannot_be_read_is_not_called_stalled(tmp_path: Path) -> None:
    """`dtrain jobs` could not read the run's metrics (its bucket unreachable): unknown, not stalled."""
    spec = {"slurm": True, "nodes": [{"name": "h0", "address": "10.0.0.1"}], "stall_after": "90s"}
    c = get("hosts").cluster(ClusterConfig(backend="hosts", name="lab", spec=spec, source=str(tmp_path / "t")))
    state = commands.job_from_scontrol(commands.parse_kv(RUNNING.replace("demo-worker-[0-1]", "h0")))
    assert job_row(c, record(), state, {}, now=1e9).stalled  # read, and no line for 2 h 30 min
    row = job_row(c, record(), state, None, now=1e9)
    assert not row.stalled and row.last_metric == {} and row.as_dict()["stalled"] is False


def test_runs_in_buckets_are_read_side_by_side_and_an_unreachable_one_is_not_waited_for(
    gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last metrics line of each run in a bucket; a bucket that cannot be reached (the storage library
    retries a refused connection for 2 minutes) is given up after `wait_s` and shows as unread (None)."""
    import os
    import socket
    import threading

    from dtrain.common.storage import open_store
    from dtrain.control.slurm.joblist import _remote_last_metrics

    def run(run_id: str, url: str) -> JobRecord:
        return JobRecord("1", "n", "mnist", run_id, url, "/d", 1, 0.0, "lab")

    for i in range(3):
        open_store(f"{gcs_bucket}/r{i}").write_bytes("metrics.jsonl", f'{{"step": 1}}\n{{"step": {i + 2}}}\n'.encode())
    live = [run(f"r{i}", f"{gcs_bucket}/r{i}") for i in range(3)] + [run("none", f"{gcs_bucket}/none")]
    got = _remote_last_metrics(live, readers=2)
    assert {k: v and v["step"] for k, v in got.items()} == {"r0": 2, "r1": 3, "r2": 4, "none": None}

    with socket.socket() as s:  # a port nothing listens on: every request is refused, and retried
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{s.getsockname()[1]}")
    assert os.environ["STORAGE_EMULATOR_HOST"].startswith("http://127.0.0.1:")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(_remote_last_metrics(live[:1], wait_s=1.0)), daemon=True)
    t.start()
    t.join(60)  # far less than the library's 120 s of retries
    assert not t.is_alive(), "waited for an unreachable bucket"
    assert result == {"r0": None}


@pytest.mark.parametrize(
    ("value", "message"),
    [("soon", 'stall_after must be a duration like "30m"'), (0, "stall_after must be more than 0 seconds")],
)
def test_a_bad_stall_after_is_one_line(tmp_path: Path, value, message: str) -> None:
    spec = {"slurm": True, "nodes": [{"name": "h0", "address": "10.0.0.1"}], "stall_after": value}
    with pytest.raises(UserError) as e:
        get("hosts").cluster(ClusterConfig(backend="hosts", name="lab", spec=spec, source=str(tmp_path / "t")))
    assert message in str(e.value) and "\n" not in str(e.value)
    from dtrain.control.gcp.spec import gcp_spec

    with pytest.raises(UserError, match="stall_after must be"):
        gcp_spec("demo", {"backend": "gcp", "stall_after": "30 minutes"}, "t")


def test_slurm_durations_and_host_lists() -> None:
    assert [elapsed_seconds(t) for t in ("1-02:03:04", "02:30:00", "05:07", "INVALID", "")] == [93784, 9000, 307, 0, 0]
    assert expand_nodelist("demo-master,demo-worker-[0-2,5]") == [
        "demo-master", "demo-worker-0", "demo-worker-1", "demo-worker-2", "demo-worker-5"
    ]  # fmt: skip
    assert expand_nodelist("n[08-10]") == ["n08", "n09", "n10"] and expand_nodelist("") == []
    assert expand_nodelist("h0") == ["h0"]


def test_a_users_slurm_cluster_takes_stall_after_too(tmp_path: Path) -> None:
    key = tmp_path / "id"
    key.write_text("k")
    login = {"host": "login.example.org", "user": "me", "key": str(key)}
    spec = {"login": login, "stall_after": "1h30m"}
    cfg = ClusterConfig(backend="slurm", name="hpc", spec=spec, source=str(tmp_path / "t.toml"))
    get("slurm").check(cfg)
    c = get("slurm").cluster(cfg)
    assert c.slurm.stall_after == 5400 and c.node_usd_per_hour is None
