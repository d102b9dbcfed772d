"""Where a built-in's checkpoints go (dtrain.common.workload.checkpoint_store): the contract's
$DTRAIN_CHECKPOINT_DIR when dtrain's launcher started this run, else the run's own checkpoints/."""

from __future__ import annotations

from dtrain.common import jobenv
from dtrain.common.storage import open_store
from dtrain.common.workload import checkpoint_store


def test_the_launchers_folder_for_its_own_run_else_the_runs_checkpoints(tmp_path, monkeypatch):
    run = open_store(str(tmp_path / "runs" / "mnist-1"))
    node = tmp_path / "node" / "checkpoints"
    monkeypatch.delenv(jobenv.CHECKPOINT_DIR, raising=False)
    monkeypatch.delenv(jobenv.RUN_URL, raising=False)
    assert checkpoint_store(run).url == run.child("checkpoints").url  # a plain torchrun

    monkeypatch.setenv(jobenv.CHECKPOINT_DIR, str(node))
    monkeypatch.setenv(jobenv.RUN_URL, str(tmp_path / "runs" / "other"))
    assert checkpoint_store(run).url == run.child("checkpoints").url  # a job started for another run

    monkeypatch.setenv(jobenv.RUN_URL, run.url + "/")
    assert checkpoint_store(run).url == str(node)  # dtrain's launcher, for this run

    # A run a previous dtrain wrote in place, with nothing restored here: its resume goes on where they are.
    run.write_bytes("checkpoints/LATEST", b"step-00000008")
    assert checkpoint_store(run).url == run.child("checkpoints").url
    node.mkdir(parents=True)
    (node / "LATEST").write_bytes(b"step-00000016")  # restored copies: the contract's folder
    assert checkpoint_store(run).url == str(node)
