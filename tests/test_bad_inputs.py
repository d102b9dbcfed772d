"""User mistakes, end to end through the real `dtrain` command in a subprocess: each one ends with
exit code 2 (ExitCode.USAGE), one `error:` line on stderr that says what was wrong and what to
do, and no Python traceback.

Each run is offline (DTRAIN_OFFLINE=1) with its cache under the test's directory (DTRAIN_CACHE_DIR),
so no test reads the user's data or reaches the internet. test_missing_data also checks that the CLI
lets those two variables through to the workload, which reads them (they are not settings).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import IMAGE_STEMS, write_dataset
from runs import RefusedResume, cli, isolated_env, snapshot

from dtrain.common.errors import ExitCode
from dtrain.mnist import data as mnist_data
from dtrain.mnist.config import Dataset

TRAIN = ["train", "mnist", "--nproc", "1", "--epochs", "1"]


dtrain = cli  # these tests read as `dtrain <args>`


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """512 random training images and 128 test images, labels 0-9, as gzip IDX files."""
    return write_dataset(tmp_path_factory.mktemp("tiny-mnist"), 512, 128, seed=0)


def _system_mnist_present() -> bool:
    return any((Path(d) / f"{IMAGE_STEMS['train']}.gz").exists() for d in mnist_data.SYSTEM_DIRS[Dataset.MNIST])


# ---------------------------------------------------------------------------------------------
# data


@pytest.mark.skipif(_system_mnist_present(), reason="this machine has MNIST in a system path, so data is never missing")
def test_missing_data(tmp_path):
    r = dtrain(tmp_path, *TRAIN, "--dataset", "mnist")
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    assert line.startswith("error: no mnist train data found; tried: ")
    for place in (
        "--data-dir (not set)",
        "$DTRAIN_MNIST_DATA_DIR (not set)",
        f"cache {tmp_path / 'cache' / 'mnist'} (no such directory)",
        *(f"system path {d}" for d in mnist_data.SYSTEM_DIRS[Dataset.MNIST]),
        "download (disabled: offline mode)",
    ):
        assert place in line
    assert line.endswith("Pass --data-dir DIR holding the IDX files")


@pytest.fixture
def cached_data(tmp_path: Path, tiny_data: Path) -> Path:
    """The tiny dataset in this test's cache, where a run without a data dir would find it."""
    return shutil.copytree(tiny_data, tmp_path / "cache" / "mnist")


GIVEN_DIR_HINT = "or leave the data dir unset to search the cache and system paths"


@pytest.mark.parametrize("how", ["flag", "dtrain.toml", "env"])
def test_data_dir_that_does_not_exist(tmp_path, cached_data, how):
    # However the user named it, a data dir is what they asked for: the copy in the cache is not
    # a substitute for it.
    nope = tmp_path / "nope"
    args, env, shown = [], isolated_env(tmp_path), str(nope)
    if how == "flag":
        args = ["--data-dir", str(nope)]
    elif how == "dtrain.toml":
        (tmp_path / "dtrain.toml").write_text('[mnist]\ndata_dir = "nope"\n')  # relative to the working dir
        shown = "nope"  # as the user wrote it
    else:
        env["DTRAIN_MNIST_DATA_DIR"] = str(nope)
    r = dtrain(tmp_path, *TRAIN, *args, env=env)
    assert r.error_line() == (
        f"error: --data-dir {shown}: no such directory; name the directory holding the IDX files "
        f"(an existing one to download them into), {GIVEN_DIR_HINT}"
    )
    assert r.code == ExitCode.USAGE
    assert not nope.exists()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []  # the refused run left nothing


def test_data_dir_with_only_the_train_files(tmp_path, cached_data):
    train_only = tmp_path / "train-only"
    train_only.mkdir()
    for stem in (IMAGE_STEMS["train"], "train-labels-idx1-ubyte"):
        shutil.copy(cached_data / f"{stem}.gz", train_only)
    r = dtrain(tmp_path, *TRAIN, "--data-dir", str(train_only))
    assert r.error_line() == (
        f"error: --data-dir {train_only} has no t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (.gz or raw), "
        f"and downloads are off (offline mode): put them there, {GIVEN_DIR_HINT}"
    )
    assert r.code == ExitCode.USAGE


def test_corrupt_idx_file(tmp_path, tiny_data):
    bad = shutil.copytree(tiny_data, tmp_path / "data")
    images = bad / f"{IMAGE_STEMS['train']}.gz"
    images.write_bytes(b"this is not an IDX file\n")
    r = dtrain(tmp_path, *TRAIN, "--data-dir", str(bad))
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    assert line.startswith(f"error: {images}: not an IDX file (bad magic 74686973")


# ---------------------------------------------------------------------------------------------
# where the run goes


def test_output_not_writable(tmp_path, tiny_data):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file\n")
    output = blocker / "runs"
    r = dtrain(tmp_path, *TRAIN, "--data-dir", str(tiny_data), "--output", str(output))
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    assert line.startswith(f"error: cannot write to {output}/mnist-")
    assert "is a file, not a directory; choose another location" in line
    assert blocker.read_text() == "a regular file\n"


def test_resume_unknown_run(tmp_path):
    r = dtrain(tmp_path, *TRAIN, "--resume", "nope")
    line = r.error_line()
    assert r.code == ExitCode.USAGE
    assert line.startswith("error: no run 'nope' found (looked in runs/nope, nope)")
    assert "`dtrain runs` lists runs" in line


# ---------------------------------------------------------------------------------------------
# a checkpoint from a different model config


@pytest.fixture(scope="module")
def refused_resume(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> RefusedResume:
    """A completed 1-epoch run (width 16, the default), then a resume of it with width 32."""
    cwd = tmp_path_factory.mktemp("resume")
    args = [*TRAIN, "--data-dir", str(tiny_data), "--batch-size", "64", "--output", "runs"]
    first = dtrain(cwd, *args)
    assert first.code == ExitCode.OK, first.out + first.err
    (run_dir,) = (cwd / "runs").iterdir()
    before = snapshot(run_dir / "checkpoints") | snapshot(run_dir / "final", "final/")
    resumed = dtrain(cwd, *args, "--resume", run_dir.name, env=isolated_env(cwd, DTRAIN_MNIST_WIDTH="32"))
    after = snapshot(run_dir / "checkpoints") | snapshot(run_dir / "final", "final/")
    runs = dtrain(cwd, "runs", "--json")
    assert runs.code == 0, runs.err
    return RefusedResume(run_dir, first, resumed, before, after, json.loads(runs.out))


def test_resume_with_other_model_config(refused_resume):
    r = refused_resume
    assert "Traceback" not in r.first.err
    assert (r.run_dir / "final" / "model.safetensors").is_file()
    line = r.resumed.error_line()
    assert r.resumed.code == ExitCode.USAGE, r.resumed.err
    assert line == (
        f"error: run {r.run_dir} was trained with a different model config (width: 16 in the run, 32 now): "
        "resume with the run's own model settings, or start a new run without --resume"
    )
    # Nothing the first run wrote was replaced: same files, same bytes.
    assert (
        sorted(r.files_after)
        == sorted(r.files_before)
        == [
            "LATEST",
            "final/curves.png",
            "final/model.json",
            "final/model.safetensors",
            "step-00000008/meta.json",
            "step-00000008/state.pt",
        ]
    )
    assert r.files_after == r.files_before


def test_refused_resume_keeps_run_completed(refused_resume):
    (row,) = refused_resume.runs_json
    assert row["run_id"] == refused_resume.run_dir.name
    assert row["status"] == "completed"
    assert row["best_value"] is not None


# ---------------------------------------------------------------------------------------------
# invalid settings


def test_invalid_epochs(tmp_path):
    r = dtrain(tmp_path, "train", "mnist", "--nproc", "1", "--epochs", "0")
    assert r.error_line() == "error: invalid configuration: mnist.epochs (from --epochs): must be >= 1, got 0"
    assert r.code == ExitCode.USAGE
    assert not (tmp_path / "runs").exists()  # refused before anything was started


def test_unknown_dataset(tmp_path):
    r = dtrain(tmp_path, *TRAIN, "--dataset", "nope")
    assert r.code == ExitCode.USAGE
    assert "Traceback" not in r.err
    (line,) = [ln for ln in r.err.splitlines() if "Invalid value" in ln]
    assert "'--dataset'" in line and "'nope'" in line
    assert "'mnist'" in line and "'fashion-mnist'" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[mnist]\nepochz = 1\n", "unknown key mnist.epochz (did you mean mnist.epochs?)"),
        ("[run]\nwidth = 32\n", "unknown key run.width (width belongs in [mnist])"),
    ],
    ids=["typo", "wrong-section"],
)
def test_config_file_unknown_key(tmp_path, toml, message):
    (tmp_path / "dtrain.toml").write_text(toml)
    r = dtrain(tmp_path, *TRAIN)
    assert r.error_line() == f"error: dtrain.toml: {message}"
    assert r.code == ExitCode.USAGE
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# naming runs, choosing where to run


def test_run_id_that_is_not_a_folder_name(tmp_path):
    r = dtrain(tmp_path, *TRAIN, "--run-id", "a/b")
    assert r.error_line() == (
        "error: invalid configuration: run.run_id (from --run-id): 'a/b' must be letters, digits, '.', '_' "
        "or '-' (a folder name)"
    )
    assert r.code == ExitCode.USAGE and not (tmp_path / "runs").exists()


def test_run_id_of_an_existing_run_is_not_reused(tmp_path, tiny_data):
    existing = tmp_path / "runs" / "mine"
    existing.mkdir(parents=True)
    (existing / "config.json").write_text('{"workload": "mnist"}')
    r = dtrain(tmp_path, *TRAIN, "--data-dir", str(tiny_data), "--run-id", "mine")
    assert r.error_line() == (
        f"error: run {existing} already exists: continue it with --resume mine, or pick another --run-id"
    )
    assert r.code == ExitCode.USAGE
    assert (existing / "config.json").read_text() == '{"workload": "mnist"}'  # untouched


def test_a_gcp_cluster_that_is_not_up(tmp_path):
    (tmp_path / "dtrain.toml").write_text('[clusters.lab]\nbackend = "gcp"\n')
    r = dtrain(tmp_path, *TRAIN, "--cluster", "lab", env=isolated_env(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "cfg")))
    assert r.error_line() == (
        "error: cluster 'lab' is not up (no record of it on this machine): run dtrain up --cluster lab"
    )
    assert r.code == ExitCode.USAGE


def test_batch_not_divisible_by_the_processes(tmp_path, tiny_data):
    r = dtrain(
        tmp_path, "train", "mnist", "--nproc", "2", "--epochs", "1", "--data-dir", str(tiny_data), "--batch-size", "63"
    )
    assert r.error_line() == "error: batch_size 63 must be divisible by the 2 processes"
    assert r.code == ExitCode.USAGE
