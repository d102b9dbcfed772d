"""`dtrain plot` and final/curves.png: PNGs of the size asked for (read from the PNG header), several
runs in one picture, and a metrics.jsonl with bad lines plotted anyway, the lines reported."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from runs import isolated_env

from dtrain.evaluate.curves import parse_metrics, png_size, smooth

from .conftest import cli


def plot(cwd: Path, *args: str):
    return cli(cwd, "plot", *args, env=isolated_env(cwd))


def test_every_completed_run_has_its_curves(mnist_run: Path, lora_run: Path):
    for run in (mnist_run, lora_run):
        assert png_size((run / "final" / "curves.png").read_bytes()) == (1500, 500), run


def test_plot_size_from_width_height_and_dpi(mnist_run: Path, lora_run: Path, tmp_path: Path):
    out = tmp_path / "both.png"
    r = plot(tmp_path, str(mnist_run), str(lora_run), "-o", str(out), "--width", "640", "--height", "480")
    assert r.code == 0, r.out + r.err
    assert png_size(out.read_bytes()) == (640, 480)
    assert f"wrote {out} (640x480) for {mnist_run.name}, {lora_run.name}" in r.out
    # dpi scales the text, not the picture.
    small = tmp_path / "dpi.png"
    r = plot(tmp_path, str(mnist_run), "-o", str(small), "--width", "800", "--height", "300", "--dpi", "50")
    assert r.code == 0, r.out + r.err
    assert png_size(small.read_bytes()) == (800, 300)
    # Default name in the working directory.
    r = plot(tmp_path, str(mnist_run))
    assert r.code == 0 and png_size((tmp_path / "curves.png").read_bytes()) == (1500, 500)


def test_bad_metrics_lines_are_skipped_and_reported(mnist_run: Path, tmp_path: Path):
    clean, torn = tmp_path / "clean" / mnist_run.name, tmp_path / "torn" / mnist_run.name
    shutil.copytree(mnist_run, clean)
    shutil.copytree(mnist_run, torn)
    lines = (mnist_run / "metrics.jsonl").read_text().splitlines()
    # A line of garbage in the middle, and a last line cut off mid-write (as a live append can leave it).
    bad = [*lines[:2], "\x00\x00garbage", *lines[2:], lines[-1][: len(lines[-1]) // 2]]
    (torn / "metrics.jsonl").write_text("\n".join(bad) + "\n")
    r = plot(tmp_path, str(torn), "-o", "torn.png")
    assert r.code == 0, r.out + r.err
    assert "metrics.jsonl line 3: not JSON, skipped" in r.out
    assert f"metrics.jsonl line {len(bad)}: not JSON, skipped" in r.out
    assert plot(tmp_path, str(clean), "-o", "clean.png").code == 0
    # The good lines are all there: the same picture as from the intact file.
    assert (tmp_path / "torn.png").read_bytes() == (tmp_path / "clean.png").read_bytes()


def test_smoothing_changes_the_picture(mnist_run: Path, tmp_path: Path):
    assert plot(tmp_path, str(mnist_run), "-o", "raw.png", "--smoothing", "0").code == 0
    assert plot(tmp_path, str(mnist_run), "-o", "smooth.png", "--smoothing", "0.9").code == 0
    assert (tmp_path / "raw.png").read_bytes() != (tmp_path / "smooth.png").read_bytes()


def test_smooth_is_debiased_and_zero_is_identity():
    assert smooth([5.0, 5.0, 5.0], 0.6) == [5.0, 5.0, 5.0]  # no pull toward zero at the start
    assert smooth([1.0, 3.0, 2.0], 0.0) == [1.0, 3.0, 2.0]
    s = smooth([0.0, 10.0], 0.5)
    assert s[0] == 0.0 and s[1] == (0.5 * 0 * 0.5 + 0.5 * 10) / (1 - 0.25)


def test_series_last_value_per_step_wins_and_non_numbers_are_left_out():
    text = "\n".join(
        json.dumps(r)
        for r in [
            {"step": 10, "loss": 2.0},
            {"step": 20, "loss": 1.5},
            {"step": 20, "loss": 1.4},  # a resumed run logged step 20 again
            {"step": 30, "loss": "1.0"},  # a string, not a number
            {"step": 35, "loss": math.nan},  # written as NaN, read back as a float that cannot be drawn
            {"step": 40, "event": "resumed"},
            [1, 2],
        ]
    )
    c = parse_metrics("r", text)
    assert c.series("loss") == ([10, 20], [2.0, 1.4])
    assert c.skipped == ["r metrics.jsonl line 7: not a JSON object, skipped"]


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_a_run_in_a_bucket_gets_its_curves_there(gcs_bucket: str, tmp_path: Path):
    """final/curves.png goes through the run's store; `dtrain plot` reads from and writes to gs:// too."""
    from dtrain.common.storage import open_store

    args = ["--dataset", "fashion-mnist", "--train-split", "train[:512]", "--eval-split", "test[:200]",
            "--batch-size", "64", "--epochs", "1", "--nproc", "1", "--output", gcs_bucket]  # fmt: skip
    r = cli(tmp_path, "train", "mnist", *args, env=isolated_env(tmp_path, DTRAIN_LOG_EVERY="2"))
    assert r.code == 0, r.out + r.err
    bucket = open_store(gcs_bucket)
    (run_id,) = {p.split("/")[0] for p in bucket.list("")}
    assert png_size(bucket.read_bytes(f"{run_id}/final/curves.png")) == (1500, 500)
    assert not (tmp_path / "runs").exists()
    r = plot(
        tmp_path, f"{gcs_bucket}/{run_id}", "-o", f"{gcs_bucket}/plots/one.png", "--width", "300", "--height", "200"
    )
    assert r.code == 0, r.out + r.err
    assert png_size(bucket.read_bytes("plots/one.png")) == (300, 200)
