"""Users' own programs on the two-host test bed (network namespaces with sshd, scripts/testbed.py): the
project synced and its requirements installed once per node, a torchrun script killed mid-run and
resumed from its own checkpoint, a command with the per-node variables, Hugging Face accelerate's own
check script under `accelerate launch`, and the failures a user meets. Real CLI, OpenSSH, torchrun and
gloo; the run goes to a gcp-storage-emulator bucket inside h0.

Needs root (skips otherwise; CI runs as root)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from projects import make_ddp_project, write_wheel
from runs import CLI, read_until_copied

from dtrain.common.errors import ExitCode

from .bed import Testbed
from .test_launch import bucket, cli_env, job_processes

pytestmark = [pytest.mark.root, pytest.mark.slow]

FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "5"}


@pytest.fixture(scope="module")
def emulator(testbed: Testbed) -> str:
    return testbed.start_gcs_emulator(testbed.hosts[0])


@pytest.fixture(scope="module")
def cwd(testbed: Testbed, known_hosts: Path, emulator: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project (tests/programs/projects/ddp, a config, a data folder, a requirements.txt naming a
    wheel kept in the project) whose dtrain.toml describes the test bed as cluster `bed`."""
    d = make_ddp_project(tmp_path_factory.mktemp("user-project") / "proj")
    wheel = write_wheel(d / "wheels", "dtrain_bed_dep", "0.1", "VALUE = 42\n")
    (d / "requirements.txt").write_text(f"--no-index\n--find-links wheels\ndtrain-bed-dep==0.1  # {wheel.name}\n")
    (d / ".gitignore").write_text("checkpoints/\nxdg-cache/\nconfig/\n")  # the tests keep these two here
    toml = testbed.cluster_toml("bed", sys.executable, env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known_hosts)
    (d / "dtrain.toml").write_text(toml)
    return d


def dtrain(cwd: Path, emulator: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`dtrain ARGS` to its end. Past `timeout` (under the tests' own 300 s, so that a hung run is seen, with
    what it printed: stop 35's CI lost a Trainer run's output to pytest's timeout) the test fails with its output."""
    try:
        return subprocess.run(
            [*CLI, *args], cwd=cwd, env={**cli_env(cwd, emulator), **FAST}, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        said = f"{out[0][-4000:]}\n{out[1][-2000:]}"
        pytest.fail(f"dtrain {' '.join(args)} ran past {timeout:.0f} s; it printed:\n{said}")


def start(cwd: Path, emulator: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], cwd=cwd, env={**cli_env(cwd, emulator), **FAST}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def run_of(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(("starting ", "resuming ")) and " run " in ln]
    return line.split(" run ", 1)[1].split()[0]


def event_line(out: str, start: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(start)]
    assert len(lines) == 1, out
    return lines[0]


def final_weights(out: str) -> list[float]:
    m = re.search(r"final weights (\[.*\])", out)
    assert m, out
    return json.loads(m.group(1))


def test_the_project_is_sent_once_and_its_requirements_installed_once_per_node(cwd: Path, emulator: str):
    out = bucket(emulator)
    # dtrain.common.launch: the module torchrun starts a script's ranks with, from the env made on top of the
    # node's (here the tests') editable dtrain install.
    check = (
        "import dtrain_bed_dep, dtrain.common.launch, os;"
        " print('DEP', dtrain_bed_dep.VALUE, os.environ['DTRAIN_NODE_RANK'])"
    )
    first = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", out, "--", "python", "-c", check)
    assert first.returncode == 0, first.stdout + first.stderr
    code = event_line(first.stdout, "code ")
    assert re.search(r"on 2 node\(s\): (\d+) file\(s\), ([\d,]+) bytes sent", code), code
    assert "requirements installed on h0, h1" in first.stdout, first.stdout
    assert sorted(re.findall(r"DEP 42 (\d)", first.stdout)) == ["0", "1"]

    second = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", out, "--", "python", "-c", check)
    assert second.returncode == 0, second.stdout + second.stderr
    assert ": unchanged in " in event_line(second.stdout, "code ")
    assert "requirements reused on every node" in second.stdout
    assert sorted(re.findall(r"DEP 42 (\d)", second.stdout)) == ["0", "1"]

    (cwd / "configs" / "extra.json").write_text('{"a": 1}')
    try:
        third = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", out, "--", "python", "-c", check)
    finally:
        (cwd / "configs" / "extra.json").unlink()
    assert third.returncode == 0, third.stdout + third.stderr
    m = re.search(r": 2 file\(s\), ([\d,]+) bytes sent in ", event_line(third.stdout, "code "))  # 1 file x 2 nodes
    assert m, third.stdout
    assert int(m.group(1).replace(",", "")) <= 2 * (16 + 10240)  # the file, in one tar record (10 KiB) a node
    assert "requirements reused on every node" in third.stdout


def test_a_command_runs_once_per_node_with_its_rank_and_the_master(cwd: Path, emulator: str, testbed: Testbed):
    line = "echo NODE=$NODE_RANK/$NNODES MASTER=$MASTER_ADDR:$MASTER_PORT RUN=$DTRAIN_RUN"
    r = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", bucket(emulator), "--", "bash", "-c", line)
    assert r.returncode == 0, r.stdout + r.stderr
    rid = run_of(r.stdout)
    got = sorted(re.findall(r"\[(h\d)\] NODE=(\d)/(\d) MASTER=([\d.]+):(\d+) RUN=(\S+)", r.stdout))
    master = testbed.hosts[0].address
    assert got == [("h0", "0", "2", master, "29400", rid), ("h1", "1", "2", master, "29400", rid)]


def test_a_torchrun_script_killed_mid_run_resumes_from_its_own_checkpoint(cwd: Path, emulator: str, testbed: Testbed):
    out = bucket(emulator)
    args = ["--steps", "60", "--ckpt-every", "10"]
    base = ["train", "train.py", "--cluster", "bed", "--nproc", "1", "--output", out, "--checkpoint-dir", "checkpoints"]
    # The uninterrupted run at full speed: the pause between steps (0.1 s) only gives the killed run time to be
    # killed mid-way, and changes no weight.
    whole = dtrain(cwd, emulator, *base, "--", *args)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    expected = final_weights(whole.stdout)

    proc = start(cwd, emulator, *base, "--", *args, "--sleep", "0.1")
    seen = read_until_copied(proc, 30, timeout=240)
    rid = run_of(seen)
    proc.send_signal(signal.SIGKILL)  # the launcher dies: the agents stop the job and copy its last checkpoint
    proc.wait()
    deadline = time.monotonic() + 30
    while any(job_processes(testbed).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(job_processes(testbed).values()), job_processes(testbed)

    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins).
    resumed = dtrain(cwd, emulator, "train", "--resume", rid, "--output", out, "--cluster", "bed", "--", "--sleep", "0")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    m = re.search(r"resumed at step (\d+)", resumed.stdout)
    assert m and int(m.group(1)) >= 30, resumed.stdout
    assert "checkpoint directory restored from the run" in resumed.stdout
    assert final_weights(resumed.stdout) == expected


def test_a_script_that_saves_every_step_keeps_a_fresh_copy_and_a_lost_master_resumes_from_it(
    cwd: Path, emulator: str, testbed: Testbed
):
    """The issue's case at dtrain's real copy interval (30 s): a script saving its one checkpoint file every step
    never let the folder settle, so no copy existed while it ran; its master was lost (every process killed,
    its checkpoint folder gone) and `--resume` started from step 0. A lone closed file is whole: it is copied
    within seconds of each save, and the resume starts close to where the master died."""
    out = bucket(emulator)
    base = ["train", "train.py", "--cluster", "bed", "--nproc", "1", "--output", out, "--checkpoint-dir", "checkpoints"]
    env = {**cli_env(cwd, emulator), **FAST, "DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "30"}
    proc = subprocess.Popen([*CLI, *base, "--", "--steps", "100000", "--ckpt-every", "1", "--sleep", "0.05"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen, killed_at = "", 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not killed_at:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen
        seen += line
        m = re.match(r"(?:\[h0\] )?step (\d+) ", line)
        if m and int(m.group(1)) >= 150:
            killed_at = int(m.group(1))
    assert killed_at, seen
    master = testbed.hosts[0]
    proc.kill()  # the launcher and the whole master go at once: nothing is copied at the end
    for pid in testbed.pids(master):
        with contextlib.suppress(OSError):
            if b"dtrain." in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    proc.wait()
    for ckpt in master.dir.rglob("checkpoints/ckpt.pt"):  # its disk is gone
        ckpt.unlink()
    end = time.monotonic() + 30
    while any(job_processes(testbed).values()) and time.monotonic() < end:
        time.sleep(0.5)
    assert not any(job_processes(testbed).values()), job_processes(testbed)

    rid = run_of(seen)
    resumed = dtrain(cwd, emulator, "train", "--resume", rid, "--output", out, "--cluster", "bed", "--", "--steps",
                     str(killed_at + 5))  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    m = re.search(r"resumed at step (\d+)", resumed.stdout)
    assert m, resumed.stdout
    # A copy seconds old: at least half the steps the master had made (a step is 0.05 s and more here).
    assert killed_at / 2 <= int(m.group(1)) <= killed_at, (killed_at, resumed.stdout)


def test_accelerates_own_check_script_under_accelerate_launch_on_two_hosts(cwd: Path, emulator: str):
    """A program this repo did not write, shipped in an installed package, started the way its docs say."""
    launch = (
        'python -m accelerate.commands.launch --multi_gpu --num_machines "$NNODES" --num_processes 2 '
        '--machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" '
        "--mixed_precision no --dynamo_backend no "
        '"$(python -c "import accelerate.test_utils.scripts.test_script as m; print(m.__file__)")"'
    )
    r = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", bucket(emulator), "--", "bash", "-c", launch,
               timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "**Test reinstantiated state**" in r.stdout
    assert "[h1]" in r.stdout and "[h0]" in r.stdout


def test_failures_on_one_node_are_named(cwd: Path, emulator: str, testbed: Testbed):
    out = bucket(emulator)
    h1 = testbed.hosts[1].address
    fails_on_h1 = f"ip -4 -o addr show | grep -q ' {h1}/' && exit 7 || true"
    r = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", out, "--setup", fails_on_h1, "--", "true")
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    (err,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "node h1" in err and "setup command 1" in err and "exited 7" in err and ".log" in err, err

    big = cwd.parent / "big-project"
    (big / "data").mkdir(parents=True)
    (big / "dtrain.toml").write_text((cwd / "dtrain.toml").read_text())
    (big / "train.py").write_text("print('never')\n")
    with open(big / "data" / "shard.bin", "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB to sync, nothing on disk
    r = dtrain(big, emulator, "train", "train.py", "--cluster", "bed", "--output", out)
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    (err,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "over the 200.0 MiB limit; largest: data/shard.bin 300.0 MiB" in err, err
    assert "never" not in r.stdout

    r = dtrain(cwd, emulator, "train", "--cluster", "bed", "--output", out, "--", "dtrain-no-such-command-xyz")
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert "cannot start dtrain-no-such-command-xyz on" in r.stdout

    bad = (
        "import os, sys, time\nif os.environ['DTRAIN_NODE_RANK'] == '1':\n"
        "    print('h1 gives up', flush=True)\n    sys.exit(1)\ntime.sleep(120)\n"
    )
    (cwd / "bad.py").write_text(bad)
    try:
        t0 = time.monotonic()
        r = dtrain(cwd, emulator, "train", "bad.py", "--cluster", "bed", "--nproc", "1", "--output", out)
    finally:
        (cwd / "bad.py").unlink()
    assert r.returncode == ExitCode.FAILURE, r.stdout + r.stderr
    assert time.monotonic() - t0 < 100
    assert "node h1 failed first (exit 1); its last lines:" in r.stdout, r.stdout
    assert "h1 gives up" in r.stdout and "dtrain: rank 1 (local rank 0) on" in r.stdout
