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
