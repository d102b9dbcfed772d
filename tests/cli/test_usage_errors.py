"""Every usage error is one line on stderr and exit 2, including the ones typer/click find themselves
(a bad choice, an unknown option), which they would print as a boxed panel of several lines."""

from __future__ import annotations

import pytest
from runs import cli

from dtrain.common.errors import ExitCode


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["train", "mnist", "--precision", "bf17"],
            "error: Invalid value for '--precision': 'bf17' is not one of 'auto', 'bf16', 'fp16', 'fp32'.",
        ),
        (
            ["train", "mnist", "--backend", "mpi"],
            "error: Invalid value for '--backend': 'mpi' is not one of 'auto', 'nccl', 'gloo'.",
        ),
        (["train", "mnist", "--epochs", "many"], "error: Invalid value for '--epochs': "),
        (["train", "mnist", "--bogus"], "error: No such option: --bogus"),
    ],
)
def test_click_usage_errors_are_one_line(tmp_path, args, line):
    r = cli(tmp_path, *args)
    assert r.code == ExitCode.USAGE, r.err
    assert r.err.count("\n") == 1 and "╭" not in r.err, r.err
    command = " ".join(["dtrain", *args[:2]])
    got = r.error_line()
    # The wording of a bad number is typer's own and changes between its releases: the start is ours to pin.
    assert got == f"{line} (see {command} --help)" or (line.endswith(": ") and got.startswith(line)), got
    assert got.endswith(f" (see {command} --help)"), got


def test_an_unknown_name_for_train_is_not_a_job_nor_a_builtin(tmp_path):
    """`dtrain train NAME` runs a [jobs.NAME] table or a built-in; anything else says what it could have been."""
    r = cli(tmp_path, "train", "gpt")
    assert r.code == ExitCode.USAGE, r.err
    assert r.error_line() == (
        "error: no job 'gpt': not a [jobs.gpt] table in dtrain.toml (none here) nor a built-in (known: lora, mnist); "
        "a script must end in .py, and a command goes after --: dtrain train -- gpt ..."
    )


def test_train_help_names_every_program_option(tmp_path):
    """The help of `dtrain train` lists each option of a user's program (dtrain.control.program.OPTIONS)."""
    from dtrain.control.program import OPTIONS

    r = cli(tmp_path, "train", "--help")
    assert r.code == 0, r.err
    text = "".join(r.out.split())  # click wraps long words at their hyphens
    missing = [o.name for o in OPTIONS if o.name not in text]
    assert missing == []
