"""The CLI never imports torch, transformers, peft, numpy or a cloud SDK for --help or config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft", "google.cloud", "google.auth", "numpy")

# A fresh interpreter: run the CLI, then report heavy modules that were imported, or even tried
# (a finder records attempts, so the check means something where torch is not installed).
PROBE = """
import json, os, sys
HEAVY = {heavy!r}
tried = []

class Record:
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HEAVY):
            tried.append(name)
        return None

sys.meta_path.insert(0, Record())
os.chdir({cwd!r})
from dtrain.cli.main import run
code = run({argv!r})
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
print("\\nPROBE " + json.dumps({{"code": code, "loaded": loaded, "tried": sorted(set(tried))}}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["config", "show"], ["config", "show", "--json"]])
def test_no_heavy_imports(tmp_path, argv):
    (tmp_path / "dtrain.toml").write_text('[mnist]\nepochs = 2\n[clusters.cc]\nbackend = "gcp"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    code = PROBE.format(heavy=HEAVY, cwd=str(tmp_path), argv=argv)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.rsplit("PROBE ", 1)[1])
    assert result == {"code": 0, "loaded": [], "tried": []}


# What `dtrain --help` needs no part of: rich's console (the help is click's plain text), the settings'
# dataclasses and the stores. Each was loaded for it once and cost a share of its start-up
# (docs/decisions.md); a module here that comes back is a cost that came back, found without timing it.
NOT_FOR_HELP = (
    "rich.console",
    "dtrain.control.settings",
    "dtrain.common.config",
    "dtrain.lora.config",
    "dtrain.common.storage",
    "dtrain.control.plots",
)


def test_top_level_help_loads_none_of_what_it_does_not_show(tmp_path):
    probe = (
        "import json, sys\nfrom dtrain.cli.main import run\ncode = run(['--help'])\n"
        f"print('\\nPROBE ' + json.dumps([code, sorted(m for m in {NOT_FOR_HELP!r} if m in sys.modules)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    p = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.rsplit("PROBE ", 1)[1]) == [0, []]
