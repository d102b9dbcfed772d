"""Bad inputs to eval, export and plot: one `error:` line each that says what to do, exit 2, and
nothing written under the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from runs import isolated_env, snapshot

from .conftest import cli


def refused(cwd: Path, *args: str) -> str:
    r = cli(cwd, *args, env=isolated_env(cwd))
    assert r.code == 2, r.out + r.err
    return r.error_line()


def test_unknown_run(tmp_path: Path):
    for command in (["eval"], ["export", "--onnx"], ["plot"]):
        line = refused(tmp_path, *command[:1], "mnist-20260101-000000-abcd", *command[1:])
        assert line.startswith("error: no run 'mnist-20260101-000000-abcd' found (looked in runs/"), line
        assert line.endswith("`dtrain runs` lists runs, or pass the run's directory")


def test_unknown_checkpoint_step_names_the_ones_there_are(mnist_run: Path):
    before = snapshot(mnist_run)
    for command in (["eval"], ["export", "--onnx"]):
        line = refused(mnist_run.parent.parent, *command[:1], str(mnist_run), "--checkpoint", "17", *command[1:])
        assert line == (
            f"error: run {mnist_run} has no complete checkpoint at step 17 (its checkpoints: 16, 32); "
            "leave out --checkpoint to use the final model"
        )
    assert snapshot(mnist_run) == before  # no eval record, no export


def test_a_checkpoint_without_its_manifest_does_not_count(mnist_run: Path, tmp_path: Path):
    """A save interrupted before meta.json is not a checkpoint to evaluate, as it is not one to resume from."""
    run = tmp_path / mnist_run.name
    shutil.copytree(mnist_run, run)
    (run / "checkpoints" / "step-00000016" / "meta.json").unlink()
    line = refused(tmp_path, "eval", str(run), "--checkpoint", "16")
    assert "has no complete checkpoint at step 16 (its checkpoints: 32)" in line


def test_onnx_export_of_a_lora_run_says_what_is_supported(lora_run: Path):
    before = snapshot(lora_run)
    line = refused(lora_run.parent.parent, "export", str(lora_run), "--onnx")
    assert line == (
        f"error: run {lora_run} is a lora run (its adapter is already saved in PEFT format under final/adapter): "
        "export --onnx supports mnist runs to ONNX only"
    )
    assert snapshot(lora_run) == before


def test_export_without_a_format(mnist_run: Path):
    assert refused(mnist_run.parent.parent, "export", str(mnist_run)) == (
        "error: name the format: dtrain export RUN --onnx (ONNX is the one there is)"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--width", "10"], "error: --width 10: pixels must be between 50 and 8000"),
        (["--smoothing", "1"], "error: --smoothing 1.0: must be in [0, 1)"),
        (["-o", "curves.jpg"], "error: -o curves.jpg: the plot is a PNG; name a file ending in .png"),
    ],
)
def test_plot_options(mnist_run: Path, tmp_path: Path, args: list[str], expected: str):
    assert refused(tmp_path, "plot", str(mnist_run), *args) == expected
    assert not list(tmp_path.glob("*.png"))


def test_prompts_for_an_mnist_run_and_a_missing_prompts_file(mnist_run: Path, lora_run: Path, tmp_path: Path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    line = refused(tmp_path, "eval", str(mnist_run), "--prompts", str(prompts))
    assert line == f"error: --prompts is for lora runs; {mnist_run} is a mnist run"
    line = refused(tmp_path, "eval", str(lora_run), "--prompts", str(tmp_path / "none.txt"))
    assert line == f"error: --prompts {tmp_path / 'none.txt'}: no such file"


def test_a_directory_that_is_not_a_run(tmp_path: Path):
    (tmp_path / "junk" / "checkpoints").mkdir(parents=True)
    (tmp_path / "junk" / "checkpoints" / "LATEST").write_text("step-00000001")
    line = refused(tmp_path, "eval", str(tmp_path / "junk"))
    assert (
        line == f"error: {tmp_path / 'junk'} has no readable config.json: not a dtrain run (`dtrain runs` lists runs)"
    )


def test_the_node_side_evaluator_comes_from_the_registry_and_a_wrong_one_is_one_line(mnist_run: Path):
    """dtrain eval passes the registry's evaluator (workloads.Builtin.evaluate); a module that is not one, or
    is not there, is refused in one line before any record is written."""
    import subprocess
    import sys

    before = snapshot(mnist_run)
    for evaluator, expected in (
        ("dtrain.evaluate.no_such",
         f"error: run {mnist_run} is a mnist run: no evaluator dtrain.evaluate.no_such for it here"),
        ("dtrain.evaluate.records", "error: dtrain.evaluate.records has no evaluate_args(run, saved, step, *, device, "
                                    "args, log): not an evaluator"),
        ("os;rm", "error: --evaluator 'os;rm': a module name, such as dtrain.evaluate.mnist"),
    ):  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "dtrain.evaluate", "eval", str(mnist_run), "--evaluator", evaluator],
                           capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert p.returncode == 2, p.stdout + p.stderr
        assert p.stderr.strip().splitlines()[-1] == expected, p.stderr
    assert snapshot(mnist_run) == before


def test_a_workload_without_a_view_gets_its_figures_as_a_table() -> None:
    from dtrain.cli import eval_cmd, eval_views

    assert eval_cmd._view("mnist") is eval_views.mnist and eval_cmd._view("lora") is eval_views.lora
    view = eval_cmd._view("toy")  # a workload the registry has no view for
    headline, details = view({"metrics": {"accuracy": 0.5, "loss": 1.25, "dataset": "toy-set"}})
    assert headline == "accuracy [bold]0.5[/], loss [bold]1.25[/]" and len(details) == 1
