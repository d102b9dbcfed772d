"""Container mode of the launcher on the multi-host test bed, for real: every host (a network namespace with its
own sshd, scripts/testbed.py) runs its own dockerd, started with `nsenter --net` into the host's namespace
(`ip netns exec` would remount /sys and hide the cgroup mounts dockerd needs), so `--network host` containers
live at the host's address. `dtrain build` pushes the image to a real registry (Debian's docker-registry) in the
root namespace; every node pulls it from there over the test bed's bridge, as VMs pull from Artifact Registry.
Checkpoints go to a GCS emulator inside h0.

Checked: a 2-host run to completion from the pulled image; HF_TOKEN reaching the job without appearing on any
command line or in the logs; Ctrl-C, a failed node and a lost launcher each leave no container on any host;
a pull that fails and a node whose docker does not work are each named in one line.

Needs root (dockerd, namespaces), docker.io, docker-registry and Debian's Fashion-MNIST.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import imagetest as d
import pytest
from cluster.bed import Testbed
from runs import CLI, isolated_env, read_until_copied

from dtrain.common.errors import ExitCode
from dtrain.common.rundir import checkpoints, read_json
from dtrain.common.storage import open_store

pytestmark = [pytest.mark.root, pytest.mark.slow]

FASHION = "/usr/share/datasets/fashion-mnist"
EPOCHS, IMAGES, BATCH = 2, 16_000, 256
STEPS = EPOCHS * (IMAGES // BATCH)
MNIST = ["train", "mnist", "--cluster", "bed", "--dataset", "fashion-mnist", "--data-dir", FASHION,
         "--epochs", str(EPOCHS), "--train-split", f"train[:{IMAGES}]", "--eval-split", "test[:2000]",
         "--batch-size", str(BATCH), "--nproc", "1"]  # fmt: skip
SECRET = f"hf_dtrain_test_{uuid.uuid4().hex}"
HANG_TIMEOUT_S = 12  # the frozen-worker test's --hang-timeout


class NodeDocker:
    """One dockerd per test-bed host, in the host's network namespace only (the filesystem is shared)."""

    def __init__(self, bed: Testbed, insecure: str) -> None:
        self.bed, self.insecure = bed, insecure
        self.procs: dict[str, subprocess.Popen] = {}

    def sock(self, host) -> str:
        return f"unix:///run/dtd-{host.namespace}.sock"

    def cli(self, host) -> str:
        return f"{d.DOCKER} -H {self.sock(host)}"

    def start(self) -> None:
        for h in self.bed.hosts:
            log = open(h.dir / "dockerd.log", "wb")  # noqa: SIM115 - the daemon owns it
            argv = ["nsenter", f"--net=/run/netns/{h.namespace}", d.DOCKERD, "--data-root", str(h.dir / "docker"),
                    "--exec-root", f"/run/dtd-{h.namespace}", "-H", self.sock(h),
                    "--pidfile", f"/run/dtd-{h.namespace}.pid", "--bridge=none", "--iptables=false",
                    "--ip-masq=false", "--ip-forward=false", "--insecure-registry", self.insecure]  # fmt: skip
            self.procs[h.name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for h in self.bed.hosts:
            deadline = time.monotonic() + d.START_TIMEOUT_S
            while not d.daemon_up(self.sock(h)):
                if self.procs[h.name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((h.dir / "dockerd.log").read_text()[-3000:])
                time.sleep(0.3)

    def run(self, host, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([d.DOCKER, "-H", self.sock(host), *args], capture_output=True, text=True, timeout=120)

    def containers(self) -> dict[str, list[str]]:
        """Every container (running or not) on each host."""
        return {h.name: self.run(h, "ps", "-a", "--format", "{{.Names}}").stdout.split() for h in self.bed.hosts}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for h in self.bed.hosts:  # the daemons' exec-roots (dockerd leaves its netns bind-mounted), sockets, pids
            root = f"/run/dtd-{h.namespace}"
            for line in Path("/proc/self/mounts").read_text().splitlines():
                target = line.split()[1]
                if target == root or target.startswith(root + "/"):
                    subprocess.run(["umount", "-l", target], capture_output=True, check=False)
            shutil.rmtree(root, ignore_errors=True)
            for suffix in (".sock", ".pid"):
                Path(f"{root}{suffix}").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory, train_image: str, registry: str) -> Iterator[dict]:
    if reason := Testbed.available():
        pytest.skip(reason)
    if not Path(FASHION, "train-images-idx3-ubyte.gz").exists():
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it as root)")
    # The real push path: dtrain build to the registry (a cache hit for the build itself).
    p = subprocess.run([*CLI, "build", "--registry", f"{registry}/dtrain", "--base-image", d.BASE_TAG], cwd=d.REPO,
                       capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    tb = Testbed.create(2, tmp_path_factory.mktemp("docker-bed"))
    port = registry.rsplit(":", 1)[1]
    nd = NodeDocker(tb, f"{tb.gateway}:{port}")
    try:
        nd.start()
        emulator = tb.start_gcs_emulator(tb.hosts[0])
        image = f"{tb.gateway}:{port}/dtrain/{train_image}"
        cwd = tmp_path_factory.mktemp("docker-bed-cwd")
        known = tb.write_known_hosts(tb.root / "known_hosts")
        toml = tb.cluster_toml("bed", "python3", env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known)
        lines = []
        for line in toml.splitlines():
            lines.append(line)
            if line.startswith("name = "):
                host = tb.host(json.loads(line.split("=", 1)[1]))
                lines.append(f"docker = {json.dumps(nd.cli(host))}")
        (cwd / "dtrain.toml").write_text("\n".join(lines) + "\n")
        yield {"tb": tb, "docker": nd, "emulator": emulator, "image": image, "cwd": cwd}
    finally:
        nd.stop()
        tb.destroy()


def env_of(bed: dict, **extra: str) -> dict[str, str]:
    cwd = bed["cwd"]
    return isolated_env(cwd, STORAGE_EMULATOR_HOST=bed["emulator"], XDG_CONFIG_HOME=str(cwd / "config"),
                        XDG_CACHE_HOME=str(cwd / "xdg-cache"), COLUMNS="200",
                        **{"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", **extra})  # fmt: skip


def bucket(emulator: str) -> str:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    os.environ["STORAGE_EMULATOR_HOST"] = emulator
    name = f"dtrain-docker-{uuid.uuid4().hex[:10]}"
    storage.Client(project="dtrain-test", credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}/runs"


def dtrain(bed: dict, *args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=bed["cwd"], env=env_of(bed, **extra), capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def start(bed: dict, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], cwd=bed["cwd"], env=env_of(bed, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def wait_running(bed: dict, p: subprocess.Popen, timeout: float = 240) -> dict[str, list[str]]:
    """Until every host runs the job's container and its workers are training (a progress line)."""
    nd = bed["docker"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = {h.name: nd.run(h, "ps", "--format", "{{.Names}}").stdout.split() for h in bed["tb"].hosts}
        if all(running.values()):
            time.sleep(8)  # into training
            return running
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.5)
    pytest.fail("the containers never ran on every host")


def no_containers_within(bed: dict, seconds: float) -> dict[str, list[str]]:
    deadline = time.monotonic() + seconds
    left = bed["docker"].containers()
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = bed["docker"].containers()
    return left


def all_command_lines() -> str:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return "\n".join(out)


def test_two_hosts_train_in_the_pulled_image(bed: dict) -> None:
    out = bucket(bed["emulator"])
    p = start(bed, *MNIST, "--output", out, "--image", bed["image"], "--checkpoint-every", "40", HF_TOKEN=SECRET)
    try:
        running = wait_running(bed, p)
        # The job's secret reached the container's environment, and no command line on this machine has it.
        names = {h: c[0] for h, c in running.items()}
        assert all(n.startswith("dtrain-mnist-") and n.endswith(f"-{h}") for h, n in names.items()), names
        tb, nd = bed["tb"], bed["docker"]
        env = json.loads(nd.run(tb.hosts[1], "inspect", "--format", "{{json .Config.Env}}", names["h1"]).stdout)
        assert f"HF_TOKEN={SECRET}" in env
        assert SECRET not in all_command_lines()
        text, _ = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, text[-4000:]
    assert SECRET not in text
    assert f"pulled {bed['image']} on 2 node(s)" in " ".join(text.split()), text[:2000]
    assert f"image {bed['image']}" in " ".join(text.split())
    run_id = [ln.split(" run ", 1)[1].split()[0] for ln in text.splitlines() if ln.startswith("starting ")][0]
    run = open_store(f"{out}/{run_id}")
    status = read_json(run, "status.json")
    assert status["state"] == "completed", status
    result = status["result"]
    assert result["world_size"] == 2 and result["steps"] == STEPS and result["accuracy"] >= 0.80, result
    assert len(status["peers"]) == 2, status["peers"]
    steps = sorted({int(f.split("/")[0].split("-")[1]) for f in checkpoints(run).list("") if f.endswith("/meta.json")})
    assert STEPS in steps and len(steps) >= 2, steps
    for log in run.list("logs"):
        assert SECRET not in run.read_bytes(log).decode(errors="replace")
    # h1 never had the image: it was pulled from the registry. Nothing is left running or stopped.
    assert bed["docker"].run(bed["tb"].hosts[1], "image", "inspect", bed["image"]).returncode == 0
    assert no_containers_within(bed, 5) == {"h0": [], "h1": []}
    # As for a user's program in an image: dtrain's node-side code went to the run (the agent inside, the mirror,
    # the built-in's module, the launcher's own version), and the image gave the libraries (torch) and Python.
    code = bed["tb"].hosts[0].workdir / "runs" / run_id / "code"
    files = {str(f.relative_to(code)) for f in code.rglob("*.py")}
    assert {"dtrain/common/nodeagent.py", "dtrain/common/mirror.py", "dtrain/mnist/train.py"} <= files, files
    assert "dtrain/control/launch.py" not in files and "dtrain/cli/main.py" not in files, files


def test_ctrl_c_leaves_no_container(bed: dict) -> None:
    p = start(bed, *MNIST, "--output", bucket(bed["emulator"]), "--image", bed["image"])
    try:
        wait_running(bed, p)
        p.send_signal(signal.SIGINT)
        left = no_containers_within(bed, 20)
        text, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert left == {"h0": [], "h1": []}, left
    assert p.returncode == ExitCode.INTERRUPTED, text[-3000:]
    assert "interrupted: stopping the job on every node" in text


def test_a_failed_node_stops_the_others(bed: dict) -> None:
    p = start(bed, *MNIST, "--output", bucket(bed["emulator"]), "--image", bed["image"])
    try:
        running = wait_running(bed, p)
        bed["docker"].run(bed["tb"].hosts[1], "kill", running["h1"][0])
        t0 = time.monotonic()
        text, _ = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == ExitCode.FAILURE, text[-3000:]
    assert elapsed < 45, elapsed
    assert no_containers_within(bed, 10) == {"h0": [], "h1": []}


def test_lost_launcher_stops_the_containers(bed: dict) -> None:
    """The launcher dies (SIGKILL, as a laptop closing): its SSH sessions end, every agent sees stdin close,
    and the containers are stopped (TERM: a checkpoint and exit 3) and removed."""
    p = start(bed, *MNIST, "--output", bucket(bed["emulator"]), "--image", bed["image"])
    try:
        wait_running(bed, p)
        os.killpg(p.pid, signal.SIGKILL)  # the CLI and its ssh clients, as when the machine goes away
        p.wait(timeout=30)
        left = no_containers_within(bed, 90)
    finally:
        if p.poll() is None:
            p.kill()
    assert left == {"h0": [], "h1": []}, left


def test_pull_failure_is_one_line_per_node(bed: dict) -> None:
    missing = bed["image"].rsplit(":", 1)[0] + ":src-000000000000"
    r = dtrain(bed, *MNIST, "--output", bucket(bed["emulator"]), "--image", missing, timeout=300)
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = [" ".join(ln.split()) for ln in r.stderr.strip().splitlines()]
    for h in bed["tb"].hosts:
        mine = [ln for ln in lines if f"node {h.name} (" in ln]
        assert len(mine) == 1, r.stderr
        assert f"cannot pull {missing} (" in mine[0]
        assert mine[0].endswith("no such image or tag in the registry: check --image (dtrain build prints the "
                                "reference it pushed)"), mine[0]  # fmt: skip


def test_a_node_without_docker_is_named(bed: dict, tmp_path: Path) -> None:
    toml = (bed["cwd"] / "dtrain.toml").read_text()
    h1 = bed["tb"].hosts[1]
    broken = toml.replace(bed["docker"].cli(h1), f"{d.DOCKER} -H unix:///run/dtd-nonexistent.sock")
    assert broken != toml
    (tmp_path / "dtrain.toml").write_text(broken)
    r = subprocess.run([*CLI, *MNIST, "--output", bucket(bed["emulator"]), "--image", bed["image"]], cwd=tmp_path,
                       env=env_of(bed), capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert err.count("error:") == 1 and "node h0" not in err, r.stderr
    assert f"node h1 (root@{h1.address}:22): `{d.DOCKER} -H unix:///run/dtd-nonexistent.sock` does not work (" in err
    assert err.endswith("start the Docker daemon there (sudo systemctl start docker)"), err


# --- a user's own program in the image ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project(bed: dict) -> Path:
    """A user's project (tests/programs/projects/ddp with its config and data, and a requirements.txt naming a
    wheel kept in the project: the bed has no index) beside the bed's dtrain.toml."""
    from projects import make_ddp_project, write_wheel

    p = make_ddp_project(bed["cwd"] / "proj")
    wheel = write_wheel(p / "wheels", "dtrain_image_dep", "0.1", "VALUE = 7\n")
    (p / "requirements.txt").write_text(f"--no-index\n--find-links wheels\ndtrain-image-dep==0.1  # {wheel.name}\n")
    shutil.copy(bed["cwd"] / "dtrain.toml", p / "dtrain.toml")
    return p


FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "5"}


def in_project(bed: dict, project: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=project, env=env_of(bed, **FAST), capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_a_users_command_runs_in_the_image_with_its_requirements(bed: dict, project: Path) -> None:
    """The requirements go into a virtualenv made by the image's Python (it sees the image's torch), once per
    node; the command runs in the job's container with the per-node variables and the SDK importable."""
    out = bucket(bed["emulator"])
    check = ("import os, torch, dtrain_image_dep; from dtrain import sdk; "
             "print('IN', os.path.exists('/.dockerenv'), dtrain_image_dep.VALUE, torch.__version__ != '', "
             "os.environ['NODE_RANK'], os.environ['NNODES'], sdk.in_dtrain())")  # fmt: skip
    args = ["train", "--cluster", "bed", "--image", bed["image"], "--output", out, "--", "python", "-c", check]
    first = in_project(bed, project, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "requirements installed on h0, h1" in first.stdout, first.stdout
    assert sorted(re.findall(r"IN True 7 True (\d) 2 True", first.stdout)) == ["0", "1"], first.stdout
    assert f"image {bed['image']}" in " ".join(first.stdout.split())
    second = in_project(bed, project, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "requirements reused on every node" in second.stdout
    assert no_containers_within(bed, 5) == {"h0": [], "h1": []}
    # The environment was made for this image, under the node's workdir, and the files are the SSH user's.
    envs = list((bed["tb"].hosts[1].workdir / "envs").glob("image-*/*/bin/python"))
    assert len(envs) == 1, envs


def test_a_users_script_in_the_image_killed_mid_run_resumes_from_its_own_checkpoint(bed: dict, project: Path):
    """torchrun DDP in the image on two hosts; the launcher dies mid-run (the containers are stopped: the
    script's checkpoint file is copied to the run by the agent inside); --resume puts it back and the script
    continues from it to the same weights as an uninterrupted run."""
    out = bucket(bed["emulator"])
    args = ["--steps", "60", "--ckpt-every", "10"]
    base = ["train", "train.py", "--cluster", "bed", "--image", bed["image"], "--nproc", "1", "--output", out,
            "--checkpoint-dir", "checkpoints"]  # fmt: skip
    # The uninterrupted run at full speed: the pause between steps (0.1 s) only gives the killed run time to be
    # killed mid-way, and changes no weight.
    whole = in_project(bed, project, *base, "--", *args)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    expected = re.search(r"final weights (\[.*\])", whole.stdout)
    assert expected, whole.stdout

    p = subprocess.Popen([*CLI, *base, "--", *args, "--sleep", "0.1"], cwd=project, env=env_of(bed, **FAST),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # fmt: skip
    try:
        seen = read_until_copied(p, 30)
        os.killpg(p.pid, signal.SIGKILL)  # the CLI and its ssh clients, as when the machine goes away
        p.wait(timeout=30)
        left = no_containers_within(bed, 90)
    finally:
        if p.poll() is None:
            p.kill()
    assert left == {"h0": [], "h1": []}, left
    rid = [ln.split(" run ", 1)[1].split()[0] for ln in seen.splitlines() if ln.startswith("starting ")][0]
    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins).
    resumed = in_project(bed, project, "train", "--resume", rid, "--output", out, "--cluster", "bed",
                         "--image", bed["image"], "--", "--sleep", "0")  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    m = re.search(r"resumed at step (\d+)", resumed.stdout)
    assert m and int(m.group(1)) >= 30, resumed.stdout
    assert "checkpoint directory restored from the run" in resumed.stdout
    assert re.search(r"final weights (\[.*\])", resumed.stdout).group(1) == expected.group(1)
    assert no_containers_within(bed, 5) == {"h0": [], "h1": []}


def test_a_frozen_worker_in_the_image_is_found_and_the_job_resumes(bed: dict) -> None:
    """A built-in's rank frozen inside its container (SIGSTOP from the host, as a GPU or NCCL hang looks): the
    agent inside the container sees its ranks, dumps the stuck one's stacks into the run, the job stops on both
    hosts and, with --max-restarts 1, trains again from its last complete checkpoint to the end. The job's
    --hang-timeout is 12 s (as on Slurm), not the automatic 30 s: what is proven here (the agent inside the
    container finds the rank, the stop and the relaunch) does not depend on the bound;
    tests/control/test_local_hangs.py proves the automatic rule through the same Watcher."""
    from cluster.test_launch import job_processes, latest_checkpoint, wait_for_checkpoint

    from dtrain.common import progress

    out = bucket(bed["emulator"])
    p = start(bed, *MNIST, "--output", out, "--image", bed["image"], "--checkpoint-every", "20", "--max-restarts", "1",
              "--hang-timeout", str(HANG_TIMEOUT_S))  # fmt: skip
    pid = None
    try:
        run_url = wait_for_checkpoint(p, out, 20)
        ckpt = latest_checkpoint(run_url)
        (worker,) = job_processes(bed["tb"], workers_only=True)["h1"]  # --nproc 1: one rank on h1
        pid = int(worker.split()[0])
        rank = progress._rank_of(pid)
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        text, _ = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            if pid:
                os.kill(pid, signal.SIGCONT)
            p.kill()
    assert p.returncode == 0, text[-4000:]
    hang = [ln for ln in text.splitlines() if ln.startswith("dtrain: hang on ")]
    assert len(hang) == 1 and hang[0].startswith(f"dtrain: hang on h1 rank {rank}: no progress for "), text[-4000:]
    run = open_store(run_url)
    stack = run.read_bytes(f"hangs/h1-rank{rank}.txt").decode()
    assert "mnist/train.py" in stack, stack  # the image's code, where the frozen rank was
    events = [json.loads(x) for x in run.read_bytes("events.jsonl").decode().splitlines() if x.strip()]
    (found,) = [e for e in events if e.get("event") == "hang"]
    assert found["time"] - frozen_at >= HANG_TIMEOUT_S - 1.0, (found, frozen_at)  # not before its bound
    resumed = [e for e in events if e.get("event") == "resumed" and e["time"] > found["time"]]
    assert resumed and resumed[0]["step"] >= ckpt, events
    status = read_json(run, "status.json")
    assert status["state"] == "completed" and status["result"]["steps"] == STEPS, status
    assert no_containers_within(bed, 10) == {"h0": [], "h1": []}
    print(f"\ncontainer mode, --hang-timeout {HANG_TIMEOUT_S}: freeze to detection {found['time'] - frozen_at:.1f} s, "
          f"to training again {resumed[0]['time'] - frozen_at:.1f} s")  # fmt: skip
