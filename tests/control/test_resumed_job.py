"""`dtrain train --resume RUN` without a program: the run's saved job, started with the run's own processes
per node (a run of 2 nodes x 1 process resumed with the CPU default of 2 per node trained as 4 ranks, and
Trainer's resume then ended on other weights: tests/cluster/test_user_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.control.jobs_file import resolve_job
from dtrain.control.program import Job, Program


def saved_run(out: Path, *, world_size: int | None, nodes: int) -> str:
    """A program run's config.json as record_start writes it (nothing else of the run is read)."""
    job = Job(name="train", program=Program(kind="script", target="train.py", args=("--lr", "1")), workdir=out)
    rid = "train-20260101-000000-abcd"
    (out / rid).mkdir(parents=True)
    cfg = {"workload": "train", "kind": "program", "job": job.to_json(), "run_id": rid, "cluster": "bed",
           "world_size": world_size, "nodes": nodes}  # fmt: skip
    (out / rid / "config.json").write_text(json.dumps(cfg))
    return rid


@pytest.mark.parametrize(
    ("world_size", "nodes", "argv", "nproc"),
    [
        (2, 2, [], 1),  # 2 nodes x 1 process: 1, not the default
        (6, 2, [], 3),
        (2, 1, [], 2),
        (2, 2, ["--nproc", "4"], 4),  # the command line still wins
        (None, 1, [], None),  # a command (no torchrun): nothing to keep
    ],
)
def test_a_resumed_run_keeps_its_processes_per_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_size: int | None, nodes: int, argv: list[str], nproc
):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs"
    rid = saved_run(out, world_size=world_size, nodes=nodes)
    job, flags, _ = resolve_job(["--resume", rid, "--output", str(out), *argv], None)
    assert job.program.args == ("--lr", "1") and job.name == "train"
    assert flags["run.nproc"] == nproc
