"""`dtrain config show`, in process and as the installed command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.cli.main import run

TOML = """\
[run]
nproc = 2
[mnist]
epochs = 3
[clusters.lab]
backend = "hosts"
"""


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith("DTRAIN_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dtrain.toml").write_text(TOML)
    return tmp_path


def by_key(rows: list[dict]) -> dict[str, dict]:
    assert all(set(r) == {"key", "value", "source"} for r in rows)
    return {r["key"]: r for r in rows}


def test_show_json(cwd, capsys, monkeypatch):
    monkeypatch.setenv("DTRAIN_PRECISION", "bf16")
    assert run(["config", "show", "--json"]) == 0
    rows = by_key(json.loads(capsys.readouterr().out))
    assert rows["run.nproc"] == {"key": "run.nproc", "value": 2, "source": "dtrain.toml"}
    assert rows["run.precision"] == {"key": "run.precision", "value": "bf16", "source": "DTRAIN_PRECISION"}
    assert rows["mnist.epochs"] == {"key": "mnist.epochs", "value": 3, "source": "dtrain.toml"}
    assert rows["mnist.lr"] == {"key": "mnist.lr", "value": 0.003, "source": "default"}
    assert rows["clusters.lab.backend"] == {"key": "clusters.lab.backend", "value": "hosts", "source": "dtrain.toml"}


def test_show_with_config_flag_and_workload(cwd, tmp_path, capsys):
    other = tmp_path / "other.toml"
    other.write_text("[mnist]\nwidth = 8\n")
    assert run(["--config", str(other), "config", "show", "--workload", "mnist", "--json"]) == 0
    rows = by_key(json.loads(capsys.readouterr().out))
    assert rows["mnist.width"]["source"] == str(other)
    assert rows["run.nproc"]["source"] == "default"  # ./dtrain.toml is not read with --config


def test_show_table(cwd, capsys):
    assert run(["config", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "value", "source", "help"]
    epochs = next(line for line in lines if line.startswith("mnist.epochs"))
    assert epochs.split()[:3] == ["mnist.epochs", "3", "dtrain.toml"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--config", "missing.toml"], {}, "config file missing.toml not found (given by --config or DTRAIN_CONFIG)"),
        ([], {"DTRAIN_MNIST_EPOCHS": "ten"}, "DTRAIN_MNIST_EPOCHS: mnist.epochs must be an integer, got 'ten'"),
        (
            [],
            {"DTRAIN_MNIST_EPOCHS": "0"},
            "invalid configuration: mnist.epochs (from DTRAIN_MNIST_EPOCHS): must be >= 1, got 0",
        ),
        ([], {}, "unknown workload 'gpt' (known: lora, mnist)"),
    ],
)
def test_show_errors_are_one_line_and_exit_2(cwd, capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    extra = ["--workload", "gpt"] if "'gpt'" in message else []
    assert run([*argv, "config", "show", "--json", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: {message}\n"


def dtrain_command() -> list[str]:
    script = Path(sys.executable).with_name("dtrain")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from dtrain.cli.main import main; main()"]


def test_installed_command(cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    env["DTRAIN_MNIST_EPOCHS"] = "9"
    p = subprocess.run(
        [*dtrain_command(), "config", "show", "--json"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert (p.returncode, p.stderr) == (0, "")
    rows = by_key(json.loads(p.stdout))
    assert rows["mnist.epochs"]["value"] == 9 and rows["mnist.epochs"]["source"] == "DTRAIN_MNIST_EPOCHS"

    env["DTRAIN_NPROCS"] = "2"
    p = subprocess.run(
        [*dtrain_command(), "config", "show"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    assert p.stderr == (
        "error: unknown environment variable DTRAIN_NPROCS (did you mean DTRAIN_NPROC?); unset it or fix its name\n"
    )


GCP_TABLE = '[clusters.demo]\nbackend = "gcp"\nproject = "dtrain-test"\nssh_source_ranges = ["203.0.113.7/32"]\n'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('autostop = "banana"', 'autostop must be a duration like "30m", "2h", "90s" or seconds, got \'banana\''),
        ("workers = 100000", "workers must be 0-63, got 100000"),
    ],
)
def test_show_refuses_a_cluster_table_that_up_and_status_would_refuse(cwd, capsys, line, message):
    """One check of a cluster table (its backend's, when dtrain.toml is read): what `config show` prints,
    `up`, `status` and `preflight` accept, and the same line refuses it everywhere."""
    from dtrain.common.errors import UserError
    from dtrain.control.gcp.spec import gcp_spec

    (cwd / "dtrain.toml").write_text(GCP_TABLE)
    assert run(["config", "show", "--json"]) == 0
    capsys.readouterr()
    (cwd / "dtrain.toml").write_text(GCP_TABLE + line + "\n")
    for argv in (["config", "show"], ["status", "--cluster", "demo"], ["preflight", "--cluster", "demo"]):
        assert run(argv) == 2, argv
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"error: dtrain.toml [clusters.demo]: {message}\n"), argv
    key, _, value = line.partition(" = ")
    with pytest.raises(UserError) as raised:
        gcp_spec("demo", {"backend": "gcp", "project": "dtrain-test", key: json.loads(value)}, "where")
    assert str(raised.value) == f"where: {message}"
