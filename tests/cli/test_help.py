"""Every command's --help: it works, and being plain text (cli/main.py's rich_markup_mode=None), it shows
no rich markup or escapes written for it."""

from __future__ import annotations

import re

import pytest
from runs import cli


def commands(cwd) -> list[list[str]]:
    top = cli(cwd, "--help").out
    names = re.findall(r"^  (\w[\w-]*)\s", top.split("Commands:", 1)[1], re.M)
    out = [[n] for n in names]
    for group in ("train", "config"):
        sub = cli(cwd, group, "--help").out
        out += [[group, n] for n in re.findall(r"^  (\w[\w-]*)\s", sub.split("Commands:", 1)[1], re.M)]
    return out


def test_every_command_has_plain_help(tmp_path):
    found = commands(tmp_path)
    assert {"train", "runs", "logs", "up", "down", "dashboard", "eval"} <= {c[0] for c in found}
    assert ["train", "mnist"] in found and ["train", "lora"] in found
    for args in [[], *found]:
        r = cli(tmp_path, *args, "--help")
        assert r.code == 0, (args, r.err)
        assert r.out.startswith("Usage: dtrain"), (args, r.out[:200])
        leftovers = re.findall(r"\\\[|\[/?(?:bold|cyan|dim|green|red|yellow|magenta)\b", r.out)
        assert not leftovers, (args, leftovers)


@pytest.mark.parametrize("workload", ["mnist", "lora"])
def test_train_help_lists_every_setting_of_the_workload(tmp_path, workload):
    """One field, one flag: every key of [run] and of the workload's section is an option."""
    from dtrain.common.config import flag
    from dtrain.control.settings import schema

    out = cli(tmp_path, "train", workload, "--help").out
    for key in schema().values():
        if key.section in ("run", workload):
            assert flag(key.name) in out, key.key


@pytest.mark.parametrize("group", ["train", "submit"])
def test_train_and_submit_help_list_every_program_option_with_its_meaning(tmp_path, group):
    """`dtrain train --help` and `dtrain submit --help` parse their program line themselves
    (dtrain.control.program); their help is a table of those options, one row each with its meaning, like
    every other command's (it was one paragraph of names, and submit's named none)."""
    from dtrain.control.program import OPTIONS, SUBMIT_OPTIONS

    out = cli(tmp_path, group, "--help").out
    table = out.split("\nOptions:\n", 1)[1].split("\nCommands:\n", 1)[0]
    rows = dict(re.findall(r"^  (--[\w-]+(?: \S+)?)\s{2,}(\S.*)$", table, re.M))
    given = [*OPTIONS, *(SUBMIT_OPTIONS if group == "submit" else [])]
    for o in given:
        name = f"{o.name} {o.metavar}" if o.takes_value else o.name
        assert name in rows, (name, table)
        assert o.help.startswith(rows[name].strip()), (name, rows[name])
    assert ("--name NAME" in rows) == (group == "submit")
