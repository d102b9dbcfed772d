"""The one front door (dtrain.control.launch): `dtrain train` and `dtrain submit`, of a built-in or of a user's
program, build one LaunchRequest and get one Plan from one builder. Fixed here: a built-in's plan dropped the
settings' stop grace period and resource sample interval (only a program's had them), and only `dtrain submit`
started a stopped (autostopped) gcp cluster: `dtrain train` went to its old addresses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtrain.control.events import Collector, Handle
from dtrain.control.launch import LaunchRequest, launch
from dtrain.control.launch_result import LaunchResult

NODES = [("demo-master", "master", "10.0.0.2"), ("demo-worker-0", "worker", "10.0.0.3")]


def _capture(monkeypatch: pytest.MonkeyPatch, launcher: str) -> list[Any]:
    """The plans the launcher `launcher` is given; it runs nothing and answers exit 0."""
    from dtrain.control import launchers

    plans: list[Any] = []
    real = launchers.get(launcher)

    def fake(plan: Any, *, events: Any, handle: Any) -> LaunchResult:
        plans.append(plan)
        return LaunchResult(plan.job.name, plan.target.run_id, plan.target.run.url, 0, plan.cluster.name)

    monkeypatch.setattr(type(real), "launch", lambda self, plan, **kw: fake(plan, **kw))
    return plans


def _program(tmp_path: Path) -> Any:
    from dtrain.control.program import SCRIPT, Job, Program

    (tmp_path / "train.py").write_text("print('hi')\n")
    return Job(name="train", program=Program(kind=SCRIPT, target="train.py"), workdir=tmp_path)


def _request(kind: str, tmp_path: Path, **kw: Any) -> LaunchRequest:
    if kind == "builtin":
        return LaunchRequest(workload="mnist", **kw)
    return LaunchRequest(job=_program(tmp_path), **kw)


@pytest.mark.parametrize("kind", ["builtin", "program"])
def test_a_plan_takes_the_settings_grace_period_and_sample_interval(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop grace period (DTRAIN_INTERNAL_STOP_GRACE_S, tests' shortening) and [run] sample_interval reach
    a built-in's plan as they reach a program's (the built-in's used to keep the defaults)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DTRAIN_INTERNAL_STOP_GRACE_S", "3")
    plans = _capture(monkeypatch, "local")
    flags = {"run.output": str(tmp_path / "runs"), "run.sample_interval": 7.5}
    result = launch(_request(kind, tmp_path, flags=flags), events=Collector(), handle=Handle())
    assert result.exit_code == 0
    (plan,) = plans
    assert (plan.grace_s, plan.sample_interval) == (3.0, 7.5)
    assert plan.own_config is (kind == "builtin")  # a built-in writes its own config.json
    assert plan.line == ("" if kind == "builtin" else "train.py")


def _gcp_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A gcp cluster as `dtrain up` leaves it on this machine (its record and key), with Slurm on its nodes."""
    from dtrain.control.gcp.record import key_path, write_record

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    nodes = [{"name": n, "role": r, "internal_ip": ip, "external_ip": "34.0.0.1", "gpus": 0, "python": "python3"}
             for n, r, ip in NODES]  # fmt: skip
    rec = {"name": "demo", "project": "dtrain-test", "zone": "us-central1-a", "bucket": "gs://dtrain-test-runs",
           "ssh_user": "dtrain", "nodes": nodes, "slurm": True}  # fmt: skip
    write_record(rec)
    key_path("demo").write_text("key")
    toml = tmp_path / "dtrain.toml"
    toml.write_text('[clusters.demo]\nbackend = "gcp"\nproject = "dtrain-test"\nzone = "us-central1-a"\n'
                    'ssh_source_ranges = ["203.0.113.7/32"]\n')  # fmt: skip
    return toml


def _stopped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The gcp cluster is stopped: its backend's ensure_running starts it once (the names it started go into
    the list returned), giving its master a new internal address in the record."""
    from dtrain.control.backends.gcp import Gcp
    from dtrain.control.gcp.record import read_record, write_record

    started: list[str] = []

    def ensure_running(self: Any, cfg: Any, *, events: Any, handle: Any) -> bool:
        if started:
            return False
        started.append(cfg.name)
        rec = read_record(cfg.name)
        rec["nodes"][0]["internal_ip"] = "10.0.0.9"
        write_record(rec)
        return True

    monkeypatch.setattr(Gcp, "ensure_running", ensure_running)
    return started


@pytest.mark.parametrize("kind", ["builtin", "program"])
def test_train_starts_a_stopped_cluster_and_runs_on_its_new_addresses(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtrain train` on an autostopped gcp cluster starts it first (as `dtrain submit` and `dtrain up` do), and
    its job goes to the addresses the start gave the nodes, not the stopped ones'."""

    monkeypatch.chdir(tmp_path)
    toml = _gcp_cluster(tmp_path, monkeypatch)
    started = _stopped(monkeypatch)
    plans = _capture(monkeypatch, "slurm")
    req = _request(
        kind, tmp_path, flags={"run.cluster": "demo", "run.output": str(tmp_path / "runs")}, config_path=toml
    )
    assert launch(req, events=Collector(), handle=Handle()).exit_code == 0
    assert started == ["demo"]
    (plan,) = plans
    assert plan.cluster.name == "demo" and plan.cluster.master.address == "10.0.0.9"
    assert plan.cluster.nodes[1].address == "10.0.0.3"


def test_submit_refuses_a_cluster_without_a_queue_before_starting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtrain submit` to a gcp cluster without Slurm is refused in one line before its stopped VMs are started
    (and paid for): the refusal comes first, the start second."""
    from dtrain.common.errors import UserError
    from dtrain.control.backends.gcp import Gcp
    from dtrain.control.gcp.record import read_record, write_record
    from dtrain.control.launch import submit

    monkeypatch.chdir(tmp_path)
    toml = _gcp_cluster(tmp_path, monkeypatch)
    rec = read_record("demo")
    del rec["slurm"]
    write_record(rec)
    started: list[str] = []
    monkeypatch.setattr(Gcp, "ensure_running", lambda self, cfg, **kw: bool(started.append(cfg.name)) or True)
    req = LaunchRequest(workload="mnist", flags={"run.cluster": "demo"}, config_path=toml)
    with pytest.raises(UserError, match=r"^cluster 'demo' lacks a job queue: jobs queue on Slurm clusters"):
        submit(req, events=Collector(), handle=Handle())
    assert started == []


@pytest.mark.parametrize("queue", [False, True])
def test_eval_on_a_stopped_cluster_starts_it_first(
    queue: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtrain eval --cluster` (on its master, or queued with --queue) starts a stopped cluster first, through the
    same backends.start_if_stopped, and works on the addresses that gave."""
    from dtrain.common.storage import open_store
    from dtrain.control import backends, evals
    from dtrain.control.settings import cluster_config
    from dtrain.control.slurm import submit as slurm_submit

    monkeypatch.chdir(tmp_path)
    cfg = cluster_config(_gcp_cluster(tmp_path, monkeypatch), "demo")
    started = _stopped(monkeypatch)
    seen: list[Any] = []
    monkeypatch.setattr(evals, "run_module", lambda target, argv, **kw: (seen.append(target.cluster), (0, ""))[1])

    def submit_module(cluster: Any, **kw: Any) -> Any:
        seen.append(cluster)
        return slurm_submit.SubmitResult("7", "e", kw["workload"], kw["run_id"], kw["url"], "demo", 1, "dtrain", False)

    monkeypatch.setattr(slurm_submit, "submit_module", submit_module)
    run = open_store(str(tmp_path / "runs" / "mnist-20260101-000000-abcd"))
    target = evals.EvalTarget(run, {"workload": "mnist"}, backends.resolve(cfg), False, cfg)
    plan = evals.EvalPlan("eval-20260101-000000-abcd", target, ["eval", run.url])
    if queue:
        assert evals.submit_eval(plan, events=Collector(), handle=Handle()).job_id == "7"
    else:
        evals.run_eval(plan, events=Collector(), handle=Handle())
    assert started == ["demo"]
    (cluster,) = seen
    assert cluster.master.address == "10.0.0.9"
