"""Users' own programs as Slurm jobs on the real Slurm bed (tests/slurm/conftest.py): a plain torchrun DDP
script with its own checkpoint file, queued, its node crashed mid-run, requeued, resumed from its own
checkpoint to the weights of an uninterrupted run; a command once per node with the per-node variables (on
the user's cluster, through its login node and shared filesystem), the project's requirements and the SDK's
metrics in `dtrain jobs`; Hugging Face accelerate's own check script under `accelerate launch`; a cancel of
a program that ignores SIGTERM; bad inputs. Real sbatch/srun, sshd, torchrun and gloo.

Needs root (network namespaces; CI runs as root), Debian's slurm-wlm and munge.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from projects import make_ddp_project, write_wheel
from runs import CLI

from dtrain.common.errors import ExitCode
from dtrain.control.slurm.commands import expand_hostlist

from .conftest import Env
from .test_slurm_bed import error_line, job_processes

pytestmark = [pytest.mark.root, pytest.mark.slow]

# A copy of the checkpoint directory every half second; 5 s between SIGTERM and SIGKILL (45 s by default).
FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "5"}
# Two nodes of cluster bed: another test of the package may have grown it to three (test_slurm_bed).
BED = ["--cluster", "bed", "--nodes", "2"]
DDP_ARGS = ["--steps", "40", "--ckpt-every", "5", "--sleep", "0.2"]  # 8 s of steps; the stop lands at step 15


@pytest.fixture(scope="module")
def project(bed: Env, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DDP project (tests/programs/projects/ddp, a config and a data file) with a requirements.txt that
    names a wheel kept in the project."""
    d = make_ddp_project(tmp_path_factory.mktemp("slurm-project") / "proj")
    write_wheel(d / "wheels", "dtrain_slurm_dep", "0.1", "VALUE = 7\n")
    (d / "requirements.txt").write_text("--no-index\n--find-links wheels\ndtrain-slurm-dep==0.1\n")
    (d / ".gitignore").write_text("checkpoints/\n")
    return d


def dtrain(bed: Env, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=bed.cwd, env={**bed.env(), **FAST}, capture_output=True, text=True, timeout=timeout
    )


def submit(bed: Env, *args: str, config: Path | None = None) -> subprocess.CompletedProcess:
    r = dtrain(bed, *(["--config", str(config)] if config else []), "submit", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().isdigit(), r.stdout  # the job id alone on stdout
    return r


def logs(bed: Env, job: str, cluster: str = "bed") -> str:
    r = dtrain(bed, "logs", job, "--cluster", cluster, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def newest_copy(run: Path) -> dict:
    """The newest manifest of the run's checkpoint-directory copies (dtrain.common.mirror), {} before one."""
    found = sorted(run.glob("ckpt/node-*/*.json"), key=lambda p: p.name)
    return json.loads(found[-1].read_text()) if found else {}


def final_weights(out: str) -> list[float]:
    (m,) = re.findall(r"final weights (\[.*\])", out)
    return json.loads(m)


def test_a_ddp_script_on_a_crashed_node_is_requeued_and_resumes_from_its_own_checkpoint(bed: Env, project: Path):
    """`dtrain train train.py --cluster bed` through Slurm (live, its exit code), then the same line queued with
    `dtrain submit` (the code is not sent again): one node dies mid-run, the job is requeued, every node puts
    the newest copy of the checkpoint directory back, and the script (no dtrain code in it) resumes from its
    own ckpt.pt to the weights of the uninterrupted run."""
    common = [*BED, "--nproc", "1", "--output", str(bed.runs), "--workdir", str(project),
              "--checkpoint-dir", "checkpoints"]  # fmt: skip
    t0 = time.monotonic()
    whole = dtrain(bed, "train", "train.py", *common, "--", *DDP_ARGS)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr
    assert re.search(r"starting train run \S+ on cluster bed through Slurm: job \d+, 2 node\(s\)", whole.stdout)
    assert re.search(r"^code \w+ \(\d+ files, [\d,]+ bytes\) on \d node\(s\): \d+ file\(s\)", whole.stdout, re.M)
    # The nodes' disks are their own: each installs the project's requirements.
    assert len(set(re.findall(r"\[(h\d)\] dtrain: requirements installed on \1", whole.stdout))) == 2, whole.stdout
    expected = final_weights(whole.stdout)
    print(f"uninterrupted run through Slurm: {time.monotonic() - t0:.1f} s")

    r = submit(bed, "train.py", *common, "--name", "ddp-crash", "--", *DDP_ARGS)
    job = r.stdout.strip()
    assert re.search(r"^code \w+ .* on \d node\(s\): unchanged in ", r.stderr, re.M), r.stderr
    row = bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    assert row["name"] == "ddp-crash" and row["workload"] == "train"
    run, nodes = Path(row["url"]), expand_hostlist(row["nodelist"])
    node_logs = [bed.sb.private(bed.sb.host(h), f"/var/lib/slurm/dtrain/runs/{run.name}/logs/{h}.log") for h in nodes]
    deadline = time.monotonic() + 300
    while not any(" step 15 " in p.read_text() for p in node_logs if p.exists()):
        assert time.monotonic() < deadline, "the job never reached step 15"
        time.sleep(0.2)
    assert "ckpt.pt" in newest_copy(run).get("files", {}), newest_copy(run)  # copied while it runs
    second = bed.sb.host(nodes[1])
    bed.sb.crash(second)
    bed.sb.revive(second)
    row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the crash")
    assert row["restarts"] == 1 and row["run_id"] == run.name, row
    out = logs(bed, job)
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", out)]
    # Both ranks (one a node) loaded the restored ckpt.pt, written at step 10 or later before the crash.
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= 10, out
    print(f"resumed at step {resumed[0]} after the crash")
    assert "checkpoint directory restored from the run" in out
    assert final_weights(out) == expected
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2 and status["exit_code"] == 0, status
    # Resource curves: the nodes' agents sampled the job, the batch step recorded their rows and each rank's peak.
    sampled = {p.stem for p in (run / "resources").glob("*.jsonl")}
    assert set(nodes) & sampled, sampled
    peaks = status["peak_memory"]
    assert sorted(peaks) == ["0", "1"], peaks
    assert all(p["node"] in sampled and p["rss_peak"] >= 64 << 20 for p in peaks.values()), peaks
    config = json.loads((run / "config.json").read_text())
    assert (config["kind"], config["world_size"], config["job"]["checkpoint_dir"]) == ("program", 2, "checkpoints")
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)


def test_a_command_on_a_users_cluster_runs_once_per_node_with_its_variables(bed: Env, project: Path):
    """A [jobs.NAME] table (`dtrain submit NAME`) whose cluster is backend = "slurm" through login node h2: the
    project synced once to the shared workdir, its requirements installed once for both nodes (one shared envs
    folder), the command (one string, under bash -c) once per node with NODE_RANK, NNODES, MASTER_ADDR,
    MASTER_PORT and dtrain's variables; the SDK's metrics are `dtrain jobs`' last metric."""
    line = (
        "echo NODE=$NODE_RANK/$NNODES MASTER=$MASTER_ADDR:$MASTER_PORT RUN=$DTRAIN_RUN RESTARTS=$DTRAIN_RESTART_COUNT; "
        "python -c 'import dtrain_slurm_dep as d; print(\"DEP\", d.VALUE)'; "
        '[ "$NODE_RANK" = 0 ] && python -c "from dtrain import sdk; sdk.log(5, loss=0.25)"; true'
    )
    table = {"command": line, "workdir": str(project), "cluster": "user", "nodes": 2}
    config = bed.cwd / "programs.toml"  # the test bed's clusters and one job
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in table.items())
    config.write_text((bed.cwd / "dtrain.toml").read_text() + f"\n[jobs.hello]\n{body}\n")
    r = submit(bed, "hello", "--output", str(bed.runs), config=config)
    job = r.stdout.strip()
    row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED", cluster="user")
    assert (row["kind"], row["name"], row["workload"], row["nodes"]) == ("program", "hello", "hello", 2), row
    out = logs(bed, job, "user")
    first, second = expand_hostlist(row["nodelist"])
    master = bed.sb.host(first).address
    got = sorted(re.findall(r"\[(h\d)\] NODE=(\d)/(\d) MASTER=([\d.]+):(\d+) RUN=(\S+) RESTARTS=(\d)", out))
    assert got == [(first, "0", "2", master, "29400", row["run_id"], "0"),
                   (second, "1", "2", master, "29400", row["run_id"], "0")], out  # fmt: skip
    assert sorted(re.findall(r"\[(h\d)\] DEP 7", out)) == [first, second]
    made = re.findall(r"\[h\d\] dtrain: requirements (installed|reused) on h\d", out)
    assert sorted(made) == ["installed", "reused"], out  # one environment for both, on the shared filesystem
    assert row["last_metric"]["step"] == 5 and row["last_metric"]["loss"] == 0.25, row
    text = dtrain(bed, "jobs", "--cluster", "user").stdout
    assert "loss 0.25 (step 5)" in " ".join(text.split()), text
    run = Path(row["url"])
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert sorted(p.name for p in (run / "logs").iterdir()) == [f"{first}.log", f"{second}.log"]  # `dtrain logs RUN`


def test_accelerates_own_check_script_under_accelerate_launch_on_two_slurm_nodes(bed: Env, project: Path):
    """A program this repo did not write, shipped in an installed package, started the way its docs say, on
    the two nodes Slurm allocates (dtrain train: live output, its exit code)."""
    launch = (
        'python -m accelerate.commands.launch --multi_gpu --num_machines "$NNODES" --num_processes 2 '
        '--machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" '
        "--mixed_precision no --dynamo_backend no "
        '"$(python -c "import accelerate.test_utils.scripts.test_script as m; print(m.__file__)")"'
    )
    r = dtrain(bed, "train", *BED, "--output", str(bed.runs), "--workdir", str(project), "--", "bash", "-c", launch)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "**Test reinstantiated state**" in r.stdout
    assert len(set(re.findall(r"^\[(h\d)\] ", r.stdout, re.M))) == 2, r.stdout[-4000:]  # both nodes' lines


def test_cancel_of_a_program_that_ignores_sigterm_leaves_nothing(bed: Env, project: Path):
    """The program gets SIGTERM and the stop file, ignores both; after the grace period (5 s here, not Slurm's
    KillWait of 60 s) it is killed on every node, the job ends CANCELLED and no process of it is left."""
    marker = "dtrain-test-stubborn"
    code = (
        f"import os, signal, time  # {marker}\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ignoring SIGTERM', flush=True)\n"
        "seen = False\n"
        "while True:\n"
        "    if not seen and os.path.exists(os.environ['DTRAIN_STOP_FILE']):\n"
        "        seen = True\n"
        "        print('stop file seen', flush=True)\n"
        "    time.sleep(0.2)\n"
    )
    r = submit(bed, *BED, "--output", str(bed.runs), "--workdir", str(project), "--", "python", "-c", code)
    job = r.stdout.strip()
    deadline = time.monotonic() + 300
    while len(re.findall(r"\[h\d\] ignoring SIGTERM", logs(bed, job))) < 2:
        assert time.monotonic() < deadline, logs(bed, job)
        time.sleep(1)
    t0 = time.monotonic()
    r = dtrain(bed, "cancel", job, "--cluster", "bed")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"job {job} CANCELLED (was RUNNING)" in r.stdout
    assert took < 40, took  # the grace period, then SIGKILL: not Slurm's KillWait
    print(f"cancel of a program that ignores SIGTERM: {took:.1f} s")
    nodes = expand_hostlist(bed.jobs("bed")[job]["nodelist"])
    assert sorted(re.findall(r"\[(h\d)\] stop file seen", logs(bed, job))) == nodes

    def left() -> dict[str, list[str]]:
        out = {}
        for h in bed.sb.hosts:
            found = []
            for pid in bed.sb.bed.pids(h):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if marker in cmd or "dtrain." in cmd:
                    found.append(cmd)
            out[h.name] = found
        return out

    deadline = time.monotonic() + 30
    while any(left().values()):
        assert time.monotonic() < deadline, left()
        time.sleep(0.5)


def test_bad_inputs_are_one_line(bed: Env, project: Path):
    before = bed.jobs("bed")
    r = dtrain(bed, "submit", "nothere.py", "--cluster", "bed", "--workdir", str(project))
    assert r.returncode == ExitCode.USAGE
    assert error_line(r) == (
        f"error: script nothere.py not found in {project}: check the path (it is relative to workdir)"
    )
    assert bed.jobs("bed") == before  # nothing queued

    r = dtrain(bed, "train", *BED, "--output", str(bed.runs), "--workdir", str(project),
               "--", "dtrain-no-such-command-xyz")  # fmt: skip
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[h") and "dtrain-no-such-command-xyz" in ln]
    assert len({ln.split()[0] for ln in lines}) == len(lines) == 2, r.stdout  # one line per node
    assert all("cannot start dtrain-no-such-command-xyz on h" in ln for ln in lines), lines
