"""Experiment trackers, against the real things: a built-in's metrics reach a real MLflow tracking server and W&B
(offline mode, read back from the files it wrote); a resumed run goes on in the same tracker run; a user's own
mlflow/wandb code works unchanged under `dtrain train`, with the trackers' variables passed through; no tracker
API key ends up in a file dtrain writes; a tracker that cannot be reached is a warning, an unknown one a one-line
error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import wandb_history, wandb_run_id, wandb_runs
from helpers import write_dataset
from runs import cli, isolated_env

from dtrain.common.errors import ExitCode

MNIST = ["train", "mnist", "--nproc", "1", "--batch-size", "64", "--log-every", "2"]
SECRETS = {"WANDB_API_KEY": "wandb-key-3f9c1e7a5b", "MLFLOW_TRACKING_TOKEN": "mlflow-token-8d2a6c4e1f"}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "data", 256, 64)  # 4 steps an epoch at batch 64


def run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_no_secret(*roots: Path) -> None:
    """No byte of any file under `roots` holds a secret's value."""
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                body = path.read_bytes()
                for name, value in SECRETS.items():
                    assert value.encode() not in body, f"{name} is in {path}"


@pytest.mark.slow  # two CLI runs of a few steps: see docs/decisions.md, "Trackers", for its duration
def test_builtin_logs_to_mlflow_and_wandb_and_a_resume_continues_their_runs(tmp_path, data, mlflow_server):
    """`--tracker mlflow,wandb`: rank 0's metrics go to the MLflow server's run, named after dtrain's, and to W&B
    (offline: read back from the files it wrote). The resumed run (one more epoch) logs into the same MLflow run
    and the same W&B run id (a second offline segment, which `wandb sync` joins), whose ids the run keeps in
    trackers.json. No API key from the environment ends up in a file dtrain wrote."""
    pytest.importorskip("wandb", reason="needs wandb (pip install -e '.[dev]')")
    from mlflow.tracking import MlflowClient

    # No WANDB_DIR: W&B's files go into the run's own folder, and are checked for secrets with the rest.
    env = isolated_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="builtin",
                       WANDB_MODE="offline", WANDB_PROJECT="builtin", **SECRETS)  # fmt: skip
    out = tmp_path / "runs"
    first = cli(tmp_path, *MNIST, "--epochs", "1", "--data-dir", str(data), "--output", str(out),
                "--tracker", "mlflow,wandb", env=env)  # fmt: skip
    assert first.code == ExitCode.OK, first.err
    run = run_dir(out)
    assert max(losses(run)) == 4
    record = json.loads((run / "trackers.json").read_text())
    client = MlflowClient(mlflow_server)
    mlflow_id = record["mlflow"]["run_id"]
    logged = client.get_run(mlflow_id)
    assert logged.info.run_name == run.name and logged.data.tags["dtrain.run_id"] == run.name
    assert logged.info.status == "FINISHED"
    assert logged.data.params["epochs"] == "1" and logged.data.params["tracker"] == "mlflow,wandb"
    assert {m.step: m.value for m in client.get_metric_history(mlflow_id, "loss")} == pytest.approx(losses(run))
    (segment,) = wandb_runs(run)
    assert wandb_run_id(segment) == record["wandb"]["id"]
    assert {int(r["step"]): r["loss"] for r in wandb_history(segment) if "loss" in r} == pytest.approx(losses(run))

    resumed = cli(tmp_path, *MNIST, "--epochs", "2", "--data-dir", str(data), "--output", str(out),
                  "--resume", str(run), env=env)  # fmt: skip
    assert resumed.code == ExitCode.OK, resumed.err
    assert max(losses(run)) == 8
    assert json.loads((run / "trackers.json").read_text()) == record
    (only,) = client.search_runs([client.get_experiment_by_name("builtin").experiment_id])  # not a second run
    assert only.info.run_id == mlflow_id and only.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(mlflow_id, "loss")} == pytest.approx(losses(run))
    segments = wandb_runs(run)
    assert len(segments) == 2 and {wandb_run_id(s) for s in segments} == {record["wandb"]["id"]}
    later = {int(r["step"]): r["loss"] for r in wandb_history(segments[1]) if "loss" in r}
    assert later == pytest.approx({s: v for s, v in losses(run).items() if s > 4})
    assert_no_secret(run, tmp_path / "cache")


def program_project(
    tmp_path: Path, program: str, mlflow_server: str, experiment: str, **extra: str
) -> tuple[Path, Path, dict[str, str]]:
    """A project folder with `program` as train.py; the folder W&B writes to; the environment of a user who set
    the trackers' variables (and their API keys) in their shell."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(program)
    wandb_dir = tmp_path / "wandb-files"
    env = isolated_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME=experiment,
                       WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), **SECRETS, **extra)  # fmt: skip
    return project, wandb_dir, env


USER_PROGRAM = """\
import os

import mlflow
import wandb

rank = int(os.environ["RANK"])
if rank == 0:  # the user's own rank-0 logging, as they wrote it for torchrun
    mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
    with mlflow.start_run(run_name=os.environ["DTRAIN_RUN"]):
        for step in range(3):
            mlflow.log_metric("user_loss", 1.0 / (step + 1), step=step)
    run = wandb.init(name=os.environ["DTRAIN_RUN"])  # project, mode and dir from WANDB_*
    for step in range(3):
        run.log({"user_loss": 1.0 / (step + 1)}, step=step)
    run.finish()
print("rank", rank, "done")
"""


@pytest.mark.slow  # one CLI run of 2 processes: see docs/decisions.md, "Trackers", for its duration
def test_a_users_own_mlflow_and_wandb_code_works_under_dtrain_train(tmp_path, mlflow_server):
    """A script that calls mlflow and wandb itself, run by `dtrain train train.py` on 2 processes: the trackers'
    variables reach it (the server's URL, the experiment, W&B's mode, project and folder), and so does the run id.
    Nothing dtrain writes holds an API key."""
    from mlflow.tracking import MlflowClient

    project, wandb_dir, env = program_project(tmp_path, USER_PROGRAM, mlflow_server, "user-program",
                                              WANDB_PROJECT="user-project")  # fmt: skip
    result = cli(project, "train", "train.py", "--nproc", "2", "--output", str(tmp_path / "runs"), env=env)
    assert result.code == ExitCode.OK, result.err
    run = run_dir(tmp_path / "runs")

    client = MlflowClient(mlflow_server)
    (logged,) = client.search_runs([client.get_experiment_by_name("user-program").experiment_id])
    assert logged.info.run_name == run.name
    assert [(m.step, m.value) for m in client.get_metric_history(logged.info.run_id, "user_loss")] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))
    ]  # fmt: skip
    (segment,) = wandb_runs(wandb_dir)
    assert [r["user_loss"] for r in wandb_history(segment) if "user_loss" in r] == pytest.approx([1.0, 0.5, 1 / 3])
    assert any(r.run.project == "user-project" for r in _records(segment))
    assert_no_secret(run, tmp_path / "cache", project)


SDK_PROGRAM = """\
from dtrain import sdk

first = 3 * sdk.restart_count()
for step in range(first, first + 3):
    sdk.log(step, sdk_loss=1.0 / (step + 1))
"""


@pytest.mark.slow  # two CLI runs of a user's program: see docs/decisions.md, "Trackers", for its duration
def test_sdk_log_reports_to_the_trackers_and_a_resume_continues_their_runs(tmp_path, mlflow_server):
    """DTRAIN_TRACKER=mlflow,wandb with a user's program that calls only `sdk.log`: its metrics reach the MLflow
    server and W&B's offline files; `dtrain train --resume` (a second start, steps 3-5) logs into the same MLflow
    run and the same W&B run id, found in trackers.json, which dtrain copied with the checkpoint directory."""
    from mlflow.tracking import MlflowClient

    project, wandb_dir, env = program_project(tmp_path, SDK_PROGRAM, mlflow_server, "sdk",
                                              DTRAIN_TRACKER="mlflow,wandb")  # fmt: skip
    out = tmp_path / "runs"
    first = cli(project, "train", "train.py", "--nproc", "1", "--output", str(out), env=env)
    assert first.code == ExitCode.OK, first.err
    run = run_dir(out)
    env.pop("DTRAIN_TRACKER")  # a resume keeps the run's own trackers
    again = cli(project, "train", "--resume", str(run), env=env)
    assert again.code == ExitCode.OK, again.err

    client = MlflowClient(mlflow_server)
    (logged,) = client.search_runs([client.get_experiment_by_name("sdk").experiment_id])
    assert logged.info.run_name == run.name and logged.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(logged.info.run_id, "sdk_loss")}
    assert history == pytest.approx({s: 1.0 / (s + 1) for s in range(6)})
    segments = wandb_runs(wandb_dir)
    assert len(segments) == 2 and len({wandb_run_id(s) for s in segments}) == 1
    rows = [r for s in segments for r in wandb_history(s) if "sdk_loss" in r]
    assert {int(r["step"]): r["sdk_loss"] for r in rows} == pytest.approx({s: 1.0 / (s + 1) for s in range(6)})
    assert_no_secret(run, tmp_path / "cache", project)


def _records(segment: Path) -> list:
    from conftest import wandb_records

    return [r for r in wandb_records(segment) if r.WhichOneof("record_type") == "run"]


def test_an_unreachable_or_missing_tracker_is_one_warning_and_no_tracker(tmp_path, monkeypatch):
    """An MLflow server that is not there (a closed port) is one warning line within the probe's timeout, not
    MLflow's minutes of retries; nothing is recorded for it, and the run goes on without it (the Reporter logs
    to no tracker). So is MLflow with no MLFLOW_TRACKING_URI."""
    pytest.importorskip("mlflow", reason="needs mlflow (pip install -e '.[dev]')")
    from conftest import free_port

    from dtrain.common.choices import Tracker
    from dtrain.common.storage import open_store
    from dtrain.common.trackers import for_run, open_trackers

    run = open_store(str(tmp_path / "run"))
    for uri, expected in ((f"http://127.0.0.1:{free_port()}", "no tracking server answers at http://127.0.0.1:"),
                          (None, "MLFLOW_TRACKING_URI is not set")):  # fmt: skip
        if uri:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        else:
            monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        warnings: list[str] = []
        trackers = open_trackers([Tracker.MLFLOW], record=run, where=for_run(run, "r", "mnist"), params={},
                                 warn=warnings.append)  # fmt: skip
        assert trackers.names == []
        assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow: ") and expected in warnings[0]
        assert warnings[0].endswith("training goes on without it")
        trackers.log(1, {"loss": 1.0})
        trackers.close("completed")
    assert not run.exists("trackers.json")


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning_and_its_end_is_bounded(monkeypatch):
    """Trackers' own rules, with stand-in trackers (a server that goes away mid-run cannot be made to on the shared
    session server): a log call that raises drops that tracker with one warning and the others go on; an end that
    never returns (MLflow's flush against a lost server) costs CLOSE_S, one warning, never the run."""
    import threading

    from dtrain.common import trackers as tmod

    class Recording(tmod._Tracker):
        name = "good"

        def __init__(self) -> None:
            self.logged: list[tuple[int, dict]] = []
            self.closed = ""

        def log(self, step, values):
            self.logged.append((step, dict(values)))

        def close(self, state):
            self.closed = state

    class Broken(tmod._Tracker):
        name = "broken"

        def log(self, step, values):
            raise ConnectionError("server went away\nsecond line")

        def close(self, state):
            threading.Event().wait()  # never returns

    monkeypatch.setattr(tmod, "CLOSE_S", 0.5)
    good, broken, warnings = Recording(), Broken(), []
    t = tmod.Trackers([broken, good], warnings.append)
    t.log(1, {"loss": 2.0, "epoch": 0, "note": "text", "flag": True})
    t.log(2, {"loss": 1.5})
    assert good.logged == [(1, {"loss": 2.0, "epoch": 0.0}), (2, {"loss": 1.5})]
    assert t.names == ["good"]
    assert warnings == [
        "warning: broken: log failed (ConnectionError: server went away); no more broken logging in this run"
    ]
    hung = tmod.Trackers([broken], warnings.append)
    hung.close("completed")
    assert warnings[-1].startswith("warning: broken: its run did not end within 0 s")
    t.close("stopped")
    assert good.closed == "stopped" and t.names == []


def test_an_unknown_tracker_is_a_one_line_error(tmp_path):
    result = cli(tmp_path, "train", "mnist", "--tracker", "neptune", "--output", str(tmp_path / "runs"))
    assert result.code == ExitCode.USAGE, result.err
    lines = [ln for ln in result.err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "neptune" in lines[0] and "mlflow | wandb" in lines[0], result.err
    assert not (tmp_path / "runs").exists()


def test_tracker_variables_travel_to_the_nodes_and_secrets_stay_out_of_slurm_job_files(monkeypatch):
    """The SSH launcher forwards every tracker variable set here (over the agent's stdin); a Slurm job's job.json,
    a file on the cluster, keeps the non-secret ones and never an API key (HF_TOKEN stays, as decided before)."""
    from dtrain.common import jobenv
    from dtrain.control.remote import FORWARD_ENV
    from dtrain.control.slurm import script

    # The class of a Slurm job's files: BatchFiles on main since its split of slurm/jobs.py, JobFiles before.
    files = getattr(script, "BatchFiles", None) or script.JobFiles

    assert set(jobenv.TRACKER_ENV) <= set(FORWARD_ENV)
    assert set(jobenv.TRACKER_ENV) >= jobenv.SECRET_ENV
    env = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "HF_TOKEN": "hf-kept", **SECRETS}
    job = {"specs": {"*": {"env": dict(env), "inner": {"env": dict(env)}}}, "name": "x"}
    written = files(script="", job=job).job_json().decode()
    assert "http://mlflow:5000" in written and "hf-kept" in written
    for value in SECRETS.values():
        assert value not in written
    assert job["specs"]["*"]["env"]["WANDB_API_KEY"] == SECRETS["WANDB_API_KEY"]  # the job itself is untouched


def test_a_list_of_trackers_goes_to_the_workload_by_value():
    """The launcher hands a built-in its settings as flags (config.to_argv): a list of Enums must be spelt by the
    values the workload's parser takes (it wrote `Tracker.MLFLOW`), and saved so in config.json (flatten)."""
    from dtrain.common import config as cfgmod
    from dtrain.common.choices import Tracker
    from dtrain.mnist.config import MnistConfig

    argv = cfgmod.to_argv({"tracker": [Tracker.MLFLOW, Tracker.WANDB]})
    assert argv == ["--tracker", "mlflow,wandb"]
    parsed = cfgmod.parse_explicit(MnistConfig, argv, prog="p", description="d")
    cfg = cfgmod.build(MnistConfig, parsed)
    assert cfg.run.tracker == [Tracker.MLFLOW, Tracker.WANDB]
    assert json.dumps(cfgmod.flatten(cfg)["tracker"]) == '["mlflow", "wandb"]'
