"""Users' own programs on this machine, through the real CLI: a torchrun script that checkpoints on its
own, a command with the per-node variables, the SDK's metrics, job tables, and the bad inputs."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from projects import write_wheel
from runs import assert_no_workers_left, dtrain, start

from dtrain.common.errors import ExitCode

FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.3", "DTRAIN_INTERNAL_STOP_GRACE_S": "3"}


def run_dir(out: Path, prefix: str) -> Path:
    (run,) = [p for p in out.iterdir() if p.name.startswith(prefix + "-")]
    return run


def final_weights(text: str) -> list[float]:
    m = re.search(r"final weights (\[.*\])", text)
    assert m, text
    return json.loads(m.group(1))


def manifests(run: Path) -> list[Path]:
    return sorted((run / "ckpt" / "node-00000").glob("0*.json")) if (run / "ckpt").exists() else []


def mirrored_step(run: Path) -> int:
    """The step of the checkpoint the newest manifest of the run's copy holds (read like the script does)."""
    import torch

    newest = json.loads(manifests(run)[-1].read_text())
    sha = newest["files"]["ckpt.pt"]["sha256"]
    return int(torch.load(run / "ckpt" / "blobs" / sha)["step"])


@pytest.mark.slow
def test_a_torchrun_script_killed_mid_run_resumes_from_its_own_checkpoint_and_ends_as_if_uninterrupted(
    ddp_project: Path, tmp_path: Path
):
    args = ["--steps", "80", "--ckpt-every", "10"]
    # The uninterrupted run, for the final weights to compare with, at full speed: the pause between steps only
    # gives the killed run below time to be killed mid-way, and changes no weight.
    whole = dtrain(["train", "train.py", "--output", str(tmp_path / "whole"), "--", *args], ddp_project, **FAST)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "rank 0" not in whole.stdout  # the script's own output, not dtrain's, is what shows
    expected = final_weights(whole.stdout)
    for p in (ddp_project / "checkpoints").glob("*"):
        p.unlink()

    out = tmp_path / "out"
    proc = start(["train", "train.py", "--output", str(out), "--checkpoint-dir", "checkpoints", "--", *args,
                  "--sleep", "0.05"], ddp_project, **FAST)  # fmt: skip
    deadline = time.monotonic() + 120
    run = None
    while time.monotonic() < deadline:
        runs = [p for p in out.glob("train-*")] if out.exists() else []
        run = runs[0] if runs else None
        if run is not None and manifests(run) and mirrored_step(run) >= 30:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    assert run is not None
    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies at once: no last copy, no goodbye
    proc.wait()
    time.sleep(1)
    assert_no_workers_left([run])
    copied = mirrored_step(run)
    # A fresh machine: the checkpoint folder is gone; only the run's copy has it.
    for p in (ddp_project / "checkpoints").glob("*"):
        p.unlink()
    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins).
    resumed = dtrain(["train", "--resume", run.name, "--output", str(out), "--", "--sleep", "0"], ddp_project, **FAST)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    m = re.search(r"resumed at step (\d+)", resumed.stdout)
    assert m, resumed.stdout
    assert int(m.group(1)) >= copied >= 30
    assert final_weights(resumed.stdout) == expected
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2


def installed_editable() -> bool:
    """Whether dtrain is installed here as scripts/setup.sh installs it: `pip install -e` (PEP 610's
    direct_url.json says so). Every dtrain distribution is looked at: the egg-info that the editable install
    leaves in the repository comes first on sys.path when the tests run from there, and says nothing."""
    from importlib.metadata import distributions

    direct = [d.read_text("direct_url.json") for d in distributions(name="dtrain")]
    return any(json.loads(t).get("dir_info", {}).get("editable") for t in direct if t)


def test_a_script_with_a_requirements_txt_runs_under_the_readmes_editable_install(tmp_path: Path):
    """The README installs dtrain editable. A project's requirements go into a venv made on top of that
    one, and torchrun starts the ranks through dtrain's own module from it, so that venv must see an
    editable dtrain (it did not: `No module named 'dtrain'`, exit 1)."""
    assert installed_editable(), "the tests run under scripts/setup.sh's editable install (pip install -e)"
    proj = tmp_path / "proj"
    write_wheel(proj / "wheels", "dtrain_local_dep", "0.1", "VALUE = 7\n")
    (proj / "requirements.txt").write_text("--no-index\n--find-links wheels\ndtrain-local-dep==0.1\n")
    script = "import dtrain_local_dep, os\nprint('DEP', dtrain_local_dep.VALUE, os.environ['RANK'])\n"
    (proj / "t.py").write_text(script)
    cache = tmp_path / "xdg-cache"
    r = dtrain(["train", "t.py", "--nproc", "2", "--output", str(tmp_path / "out")], proj, XDG_CACHE_HOME=str(cache))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "requirements installed" in r.stdout, r.stdout
    assert sorted(re.findall(r"DEP 7 (\d)", r.stdout)) == ["0", "1"], r.stdout
    assert len(list((cache / "dtrain" / "envs").glob("*/.dtrain-ready"))) == 1


def printed_resume_line(text: str) -> list[str]:
    m = re.search(r"`(dtrain train [^`]*--resume [^`]*)`", text)
    assert m, text
    return shlex.split(m.group(1))[1:]


def fails_on_its_first_start(tmp_path: Path, line: str) -> Path:
    """A project whose t.py runs `line`, then exits 1 on its first start only (a file in its folder says)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "t.py").write_text(
        f"import os, sys\n{line}\n"
        "if not os.path.exists('started'):\n    open('started', 'w').close()\n    sys.exit(1)\n"
    )
    return proj


def test_the_resume_line_printed_for_a_run_given_output_works_as_printed(tmp_path: Path):
    """`--output DIR` puts the run at DIR/<id>, where a bare id is not looked for: the line names the run
    by its place, and running it exactly, from the same folder, continues the run."""
    proj = fails_on_its_first_start(tmp_path, "print('CONTINUED', os.environ['DTRAIN_RUN'])")
    first = dtrain(["train", "t.py", "--nproc", "1", "--output", "elsewhere"], proj)
    assert first.returncode == 1, first.stdout + first.stderr
    run = run_dir(proj / "elsewhere", "t")
    line = printed_resume_line(first.stderr)
    assert line == ["train", "--resume", f"./elsewhere/{run.name}"], first.stderr
    again = dtrain(line, proj)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"CONTINUED {run.name}" in again.stdout
    assert json.loads((run / "status.json").read_text())["state"] == "completed"


def test_resume_with_arguments_after_the_separator_adds_them_to_the_runs_own_program_line(tmp_path: Path):
    """`dtrain train --resume RUN -- ARGS` (an HF Trainer user's `-- --resume_from_checkpoint DIR`): the run's
    program again, its own arguments first and ARGS after them; it took ARGS for a command to run instead
    (`--resume_from_checkpoint: command not found`)."""
    proj = fails_on_its_first_start(tmp_path, "print('ARGV', *sys.argv[1:])")
    first = dtrain(["train", "t.py", "--lr", "1", "--nproc", "1"], proj)
    assert first.returncode == 1, first.stdout + first.stderr
    run = run_dir(proj / "runs", "t")
    again = dtrain(["train", "--resume", run.name, "--", "--resume_from_checkpoint", "ckpt/checkpoint-20"], proj)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ARGV --lr 1 --resume_from_checkpoint ckpt/checkpoint-20" in again.stdout, again.stdout
    assert json.loads((run / "status.json").read_text())["state"] == "completed"


def test_a_program_that_exits_3_unasked_failed_and_was_not_preempted(tmp_path: Path):
    """Exit 3 is "preempted: safe to resume" only for a stop that was asked for. A rank that exits 3 by
    itself was recorded preempted, with a resume hint, though nobody asked it to stop."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "t.py").write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    r = dtrain(["train", "t.py", "--nproc", "2"], proj)
    assert r.returncode == ExitCode.FAILURE, r.stdout + r.stderr
    status = json.loads((run_dir(proj / "runs", "t") / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 1), status
    assert " failed (exit 1)" in r.stderr and "stopped" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_command_runs_once_with_the_node_variables_and_dtrains_own(tmp_path: Path):
    line = "echo NODE=$NODE_RANK/$NNODES MASTER=$MASTER_ADDR:$MASTER_PORT RUN=$DTRAIN_RUN CKPT=$DTRAIN_CHECKPOINT_DIR"
    r = dtrain(["train", "--output", str(tmp_path / "out"), "--", "bash", "-c", line], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run = run_dir(tmp_path / "out", "bash")
    (got,) = [ln for ln in r.stdout.splitlines() if ln.startswith("NODE=")]
    node, master, rid, ckpt = (part.split("=", 1)[1] for part in got.split())
    assert node == "0/1"
    host, port = master.split(":")
    assert host == "127.0.0.1" and 1024 <= int(port) <= 65535
    assert rid == run.name
    assert Path(ckpt) == run / "checkpoints"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["kind"] == "program" and cfg["job"]["program"] == {
        "kind": "command",
        "target": "",
        "args": ["bash", "-c", line],
    }


@pytest.mark.slow
def test_the_sdk_metrics_reach_the_run_and_dtrain_plot(tmp_path: Path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "fit.py").write_text(
        "import math\nfrom dtrain import sdk\n"
        "for step in range(1, 31):\n    sdk.log(step, loss=math.exp(-step / 10), lr=0.1)\n"
        "print('checkpoint dir', sdk.checkpoint_dir())\n"
    )
    r = dtrain(["train", "fit.py", "--nproc", "1", "--output", str(tmp_path / "out")], proj)
    assert r.returncode == 0, r.stdout + r.stderr
    run = run_dir(tmp_path / "out", "fit")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert rows[-1]["loss"] == pytest.approx(math_exp(-3.0))
    png = tmp_path / "curves.png"
    p = dtrain(["plot", run.name, "--output", str(tmp_path / "out"), "-o", str(png)], proj)
    assert p.returncode == 0, p.stdout + p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    listed = dtrain(["runs", "--output", str(tmp_path / "out"), "--json"], proj)
    (row,) = json.loads(listed.stdout)
    assert row["run_id"] == run.name and row["status"] == "completed" and row["workload"] == "fit"


def math_exp(x: float) -> float:
    import math

    return math.exp(x)


@pytest.mark.slow
def test_a_job_table_with_flags_over_it(tmp_path: Path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "show.py").write_text(
        "import os, sys\nprint('ARGS', sys.argv[1:], os.environ['GREETING'], os.environ['WORLD_SIZE'])\n"
    )
    (proj / "dtrain.toml").write_text(
        '[jobs.greet]\nscript = "show.py"\nargs = ["--a", "1"]\nenv = {GREETING = "hello"}\nnproc = 2\n'
    )
    r = dtrain(
        ["train", "greet", "--nproc", "1", "--env", "GREETING=hi", "--output", str(tmp_path / "out"), "--", "--b"], proj
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ARGS ['--a', '1', '--b'] hi 1" in r.stdout


@pytest.mark.slow
def test_one_rank_exiting_1_names_the_rank_and_stops_the_others(tmp_path: Path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "bad.py").write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    print('rank 1: giving up', flush=True)\n"
        "    sys.exit(1)\ntime.sleep(120)\n"
    )
    t0 = time.monotonic()
    r = dtrain(["train", "bad.py", "--nproc", "2", "--output", str(tmp_path / "out")], proj)
    assert r.returncode == ExitCode.FAILURE
    assert time.monotonic() - t0 < 60  # rank 0 did not sleep its 120 s: it was stopped
    assert "rank 1: giving up" in r.stdout
    assert "dtrain: rank 1 (local rank 1) on" in r.stdout and "exited with code 1" in r.stdout
    run = run_dir(tmp_path / "out", "bad")
    assert json.loads((run / "status.json").read_text())["state"] == "failed"
    assert_no_workers_left([run])


@pytest.mark.slow
def test_a_program_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "stubborn.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = start(["train", "stubborn.py", "--nproc", "1", "--output", str(tmp_path / "out")], proj, **FAST)
    deadline = time.monotonic() + 60
    buf = ""
    while "ready" not in buf and time.monotonic() < deadline:
        buf += proc.stdout.readline()
    assert "ready" in buf
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20  # the 3 s grace, then SIGKILL
    run = run_dir(tmp_path / "out", "stubborn")
    time.sleep(0.5)
    assert_no_workers_left([run])
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "stubborn.py" not in out


def test_bad_inputs_are_one_line_and_leave_no_run(tmp_path: Path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "x.py").write_text("print('never')\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dtrain.toml").write_text('[jobs.broken]\nscript = "x.py"\ncommand = ["true"]\n')
    r = dtrain(["train", "broken"], broken)
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.strip() == (
        "error: dtrain.toml: [jobs.broken] needs exactly one of script, module or command (got script and command)"
    )
    cases = {
        ("train", "missing.py"): "error: script missing.py not found in",
        (
            "train",
            "--",
            "dtrain-no-such-command-xyz",
        ): "error: command not found on this machine: dtrain-no-such-command-xyz",
        ("train", "--nodes", "two", "x.py"): "error: --nodes must be a whole number, got 'two'",
        ("train", "--lr", "3", "x.py"): "error: unknown option --lr before the program",
        ("train", "some/dir"): "is not a Python script (*.py), a module (-m), or a job name",
        ("train", "--time", "10", "x.py"): "error: --time needs a job time limit, and this machine has none",
    }
    for argv, wanted in cases.items():
        r = dtrain([*argv, "--output", str(tmp_path / "out")] if "--" not in argv else list(argv), proj)
        assert r.returncode == ExitCode.USAGE, (argv, r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and wanted in lines[0], (argv, r.stderr)
    assert not (tmp_path / "out").exists() and not (proj / "runs").exists() and not (broken / "runs").exists()
