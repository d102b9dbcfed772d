"""A full disk when `--resume` rewrites the run's files at the start of a run (the launcher's status.json, as it
records the start, before the workload's config.json): one line naming the file and the bytes, exit 1, and the
run as it was (config.json, status.json and the checkpoints)."""

from __future__ import annotations

import json

import pytest
from helpers import write_dataset
from runs import cli

from dtrain.common.errors import ExitCode

MNIST = ["train", "mnist", "--nproc", "1", "--epochs", "1", "--batch-size", "64"]


@pytest.mark.root
@pytest.mark.slow  # two CLI runs: about 20 s here
def test_a_full_disk_when_resume_rewrites_config_json_is_one_line(tmp_path, tmpfs):
    data = write_dataset(tmp_path / "data", 256, 64)
    disk = tmpfs("4m")
    out = disk.path / "runs"
    first = cli(tmp_path, *MNIST, "--data-dir", str(data), "--output", str(out))
    assert first.code == ExitCode.OK, first.err
    (run,) = out.iterdir()
    before = {name: (run / name).read_bytes() for name in ("config.json", "status.json")}
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())

    # Fill what is left of the disk, then resume with one more epoch.
    with open(disk.path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    resumed = cli(tmp_path, *MNIST[:-4], "--epochs", "2", "--batch-size", "64", "--resume", run.name,
                  "--output", str(out))  # fmt: skip
    assert resumed.code == ExitCode.FAILURE, resumed.err
    assert "Traceback" not in resumed.err, resumed.err
    errors = [ln for ln in resumed.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: disk full: writing {run / 'status.json'} needed "), (
        resumed.err
    )
    assert errors[0].endswith(f"the run's files are as they were: free space and resume again (--resume {run.name})")
    assert {name: (run / name).read_bytes() for name in before} == before
    assert json.loads(before["status.json"])["state"] == "completed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
