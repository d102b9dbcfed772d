"""The CLI's side of eval, export and plot imports no torch: the torch work happens in the
`python -m dtrain.evaluate` subprocess. Without torch here, eval says what to install and leaves
nothing under the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runs import isolated_env

# A fresh interpreter runs the CLI in-process, then lists the heavy modules it imported; `hide`
# makes torch absent (sys.modules[name] = None is how Python marks a module that cannot be imported).
PROBE = """
import json, os, sys
for name in {hide!r}:
    sys.modules[name] = None
os.chdir({cwd!r})
from dtrain.cli.main import run
code = run({argv!r})
loaded = sorted({{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}} & set({heavy!r}))
print("\\nPROBE " + json.dumps({{"code": code, "loaded": loaded}}))
"""
NOT_IN_THE_CLI = ["torch", "transformers", "peft", "onnx", "onnxruntime", "onnxscript", "safetensors"]


def probe(cwd: Path, argv: list[str], hide: list[str] = ()) -> subprocess.CompletedProcess:
    code = PROBE.format(hide=list(hide), cwd=str(cwd), argv=argv, heavy=[*NOT_IN_THE_CLI, "numpy", "matplotlib"])
    return subprocess.run([sys.executable, "-c", code], env=isolated_env(cwd), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def outcome(p: subprocess.CompletedProcess) -> dict:
    assert "PROBE " in p.stdout, p.stdout + p.stderr
    return json.loads(p.stdout.rsplit("PROBE ", 1)[1])


def test_eval_and_export_run_torch_in_a_subprocess_only(mnist_run: Path, tmp_path: Path):
    for argv in (["eval", str(mnist_run), "--json"], ["export", str(mnist_run), "--onnx", "--json"]):
        result = outcome(probe(tmp_path, argv))
        assert result == {"code": 0, "loaded": []}, argv  # not even numpy: only the subprocess had it


def test_plot_draws_without_torch(mnist_run: Path, tmp_path: Path):
    result = outcome(probe(tmp_path, ["plot", str(mnist_run), "-o", "c.png"], hide=["torch"]))
    assert result["code"] == 0 and (tmp_path / "c.png").exists()
    assert not set(result["loaded"]) & set(NOT_IN_THE_CLI), result


def test_eval_without_torch_says_what_to_install(mnist_run: Path, tmp_path: Path):
    before = sorted(p.name for p in (mnist_run / "eval").glob("*")) if (mnist_run / "eval").exists() else []
    p = probe(tmp_path, ["eval", str(mnist_run)], hide=["torch"])
    assert outcome(p)["code"] == 2
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: evaluating on this machine needs torch, which this Python (")
    assert line.endswith("pip install 'dtrain[eval]', or evaluate on a cluster with --cluster NAME")
    after = sorted(p.name for p in (mnist_run / "eval").glob("*")) if (mnist_run / "eval").exists() else []
    assert after == before  # no pending record left behind
