"""The steps a job on a cluster's nodes takes over SSH, for every job (a user's program or a built-in: both are
launched by dtrain.control.remote_program), `dtrain eval --cluster` and the node checks. Each fails with a
one-line error that names the node:
1. connect to every node at once (dtrain.control.ssh; host keys checked against dtrain's known_hosts; one
   multiplexed connection per node, opened by the first command of a launch);
2. sync dtrain's node-side code (the agent, the SDK, the built-ins' packages) to a per-run directory on each
   node, `<workdir>/runs/<run id>/code` (`code_archive`). In container mode `docker` is checked on every node
   and the image pulled on all of them at once;
3. ask each node for its Python, torch, CPUs and GPUs (nodeagent info; for a user's program, the same
   process that receives its code and checks its environment reports them: remote_program.deps_command);
4. check every worker can open a TCP connection to the master's rendezvous port (check_port: the workers try
   while the master's listener starts, at the same time as step 3);
5. start `nodeagent run` on every node, which runs torchrun with a c10d rendezvous on the master
   (`--rdzv-conf is_host=1` there), `--local-addr` set to the node's cluster address and the run id
   as the rendezvous id; the job's environment travels over SSH's stdin, never on a command line;
6. report every node's output as events (the CLI prints them prefixed with the node's name) and write
   them to `logs/<node>.log` under the run; rank 0's progress comes as events too (`NodeAgents`);
7. the caller's Handle: INTERRUPT sends INT to every node's job, KILL 5 s later; KILL at once;
   TERMINATE sends TERM (the ranks checkpoint and exit PREEMPTED). A node whose job
   fails (or whose SSH connection dies) fails the job: the others get KILL after a short grace, so
   nothing hangs;
8. hangs (docs/hangs.md): an agent that finds a rank without progress sends its stacks, which go to the run's
   hangs/<node>-rank<r>.txt, with one line and a "hang" event; the job is stopped on every node and counts
   as failed (ExitCode.HUNG) for the relaunch. An agent silent for its hang timeout counts as a hung node.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import gzip
import hashlib
import importlib.util
import io
import json
import os
import queue
import shlex
import subprocess
import tarfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from dtrain.common import jobenv
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.launch import torchrun_argv
from dtrain.common.metrics import PROGRESS_PREFIX
from dtrain.common.nodeagent import CONTROL_PREFIX
from dtrain.common.progress import StragglerSet
from dtrain.common.resources import EVENT as RESOURCES_EVENT
from dtrain.common.resources import Recorder
from dtrain.common.storage import Store, is_remote
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Events, Handle, Stop
from dtrain.control.ssh import SSH, NodeError, explain

AGENT = "dtrain.common.nodeagent"
INT_GRACE_S = 5.0  # Ctrl-C: the job's processes get this long to exit before they are killed
FAIL_FAST_GRACE_S = 15.0  # a node failed: the others get this long to notice before they are killed
HANG_GRACE_S = 5.0  # a node reported a hang: the others get SIGTERM, and SIGKILL this much later
SILENT_FLOOR_S = 30.0  # an agent that printed nothing (not even its "alive" line) this long, at least: hung
PORT_CHECK_TIMEOUT_S = 5.0
EARLY_CONNECT_S = 3.0  # check_port: a client started with the listener tries a refused port again this long
LOG_SYNC_S = 2.0  # a node's lines reach the run's logs/ at least this often (and at the end)
JOB_ENDED = "dtrain: job ended"  # the last line of each node's log for one launch of the job
# Passed to the job on every node when set here (over stdin, never on a command line or in a log).
# The experiment trackers' settings go too (jobenv.TRACKER_ENV), so a program's own MLflow/W&B code works as here.
FORWARD_ENV = ("STORAGE_EMULATOR_HOST", "HF_TOKEN", "HF_HUB_OFFLINE", "DTRAIN_OFFLINE", "HF_ENDPOINT",
               *jobenv.TRACKER_ENV)  # fmt: skip
DOCKER_CHECK_TIMEOUT_S = 60
PULL_TIMEOUT_S = 1800  # a multi-GB CUDA image over a slow link
# Workload arguments that may name paths on the nodes: mounted at the same path inside the container.
PATH_ARGS = {"data_dir": "ro", "data": "ro", "model": "ro", "output": "rw"}


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    python: str
    torch: str | None
    cpus: int
    gpus: int
    disk_free_bytes: int
    raw: dict[str, Any]

    @classmethod
    def parse(cls, node: Node, text: str) -> NodeInfo:
        try:
            d = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise NodeError(node, f"nodeagent info printed no JSON: {text.strip()[:200]!r}") from None
        return cls(d["python"], d.get("torch"), int(d["cpus"]), len(d.get("gpus") or []), d["disk_free_bytes"], d)


def workload_packages() -> list[str]:
    """dtrain's node-side packages: common (the agent, torchrun's wrapper, checkpoints), sdk (for users'
    programs), evaluate (runs draw their curves; `dtrain eval --cluster`) and each built-in's own package."""
    from dtrain.control.workloads import builtin_packages

    return ["common", "sdk", *builtin_packages(), "evaluate"]


def code_archive() -> tuple[bytes, str]:
    """dtrain's workload-side packages (dtrain/common, dtrain/mnist, ...) as a gzip'd tar, and its
    digest. The CLI stays behind: nodes run only the workloads and the agent."""
    buf = io.BytesIO()
    # gzip's header holds a time: 0, so the same code gives the same digest (and archive) on every launch.
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for name in workload_packages():
            spec = importlib.util.find_spec(f"dtrain.{name}")
            assert spec is not None and spec.submodule_search_locations, name
            root = Path(list(spec.submodule_search_locations)[0])
            for f in sorted(root.rglob("*")):
                if "__pycache__" in f.parts or f.suffix == ".pyc" or not f.is_file():
                    continue
                ti = tarfile.TarInfo(f"dtrain/{name}/{f.relative_to(root).as_posix()}")
                data = f.read_bytes()
                ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                tar.addfile(ti, io.BytesIO(data))
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()[:12]


def run_dir(node: Node, run_id: str) -> str:
    return f"{node.workdir.rstrip('/')}/runs/{run_id}"


def agent_command(node: Node, run_id: str, *args: str) -> str:
    """The shell line that runs the agent from the run's synced code on `node`."""
    return (
        f'cd {shlex.quote(run_dir(node, run_id))} && PYTHONPATH="$PWD/code" '
        f"exec {shlex.quote(node.python)} -m {AGENT} {shlex.join(args)}"
    )


def sync_node(ssh: SSH, node: Node, run_id: str, archive: bytes) -> None:
    """Unpack `archive` (code_archive()) into the run's code directory on `node`."""
    d = shlex.quote(f"{run_dir(node, run_id)}/code")
    ssh.run(node, f"mkdir -p {d} && tar -xzf - -C {d}", input=archive, timeout=120)


def sync_code(ssh: SSH, run_id: str, archive: bytes) -> None:
    ssh.each(lambda node: sync_node(ssh, node, run_id, archive))


def node_info(ssh: SSH, node: Node, run_id: str) -> NodeInfo:
    """What `nodeagent info` reports for `node` (its code synced for `run_id`); disk is its workdir's."""
    p = ssh.run(
        node,
        agent_command(node, run_id, "info", "--workdir", "../..", "--addr", node.address, "--cached"),
        timeout=120,
        check=False,
    )
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        raise NodeError(node, f"cannot run {node.python} there ({err[0]}): set python = ... for it")
    return NodeInfo.parse(node, p.stdout.decode(errors="replace"))


def node_infos(ssh: SSH, run_id: str, *, container: bool = False) -> dict[str, NodeInfo]:
    return checked_infos(ssh.cluster, ssh.each(lambda node: node_info(ssh, node, run_id)), container=container)


def checked_infos(cluster: Cluster, infos: dict[str, NodeInfo], *, container: bool = False) -> dict[str, NodeInfo]:
    """`infos` (node -> what `nodeagent info` said), once every node has torch and the master's versions."""
    if container:
        return infos  # torch and its Python are the image's, the same on every node
    for node in cluster.nodes:
        if infos[node.name].torch is None:
            raise NodeError(
                node,
                f"{node.python} has no torch ({infos[node.name].raw.get('torch_error', '')}): install dtrain's "
                "training dependencies there, or point python = ... at an environment that has them",
            )
    check_versions(cluster, infos)
    return infos


def on_every_node(ssh: SSH, fn: Any) -> dict[str, Any]:
    """fn(node) on every node at once; fails with one line per node that failed (each names the node)."""
    import concurrent.futures

    nodes = list(ssh.cluster.nodes)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futures = {n.name: pool.submit(fn, n) for n in nodes}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    for e in failed:
        if not isinstance(e, UserError):
            raise e  # type: ignore[misc]
    if failed:
        raise UserError("\n".join(str(e) for e in failed))
    return {name: f.result() for name, f in futures.items()}


def docker_command(node: Node, *args: str) -> str:
    return shlex.join([*shlex.split(node.docker), *args])


def check_docker(ssh: SSH) -> dict[str, str]:
    """`docker` works on every node (its daemon answers); returns each node's engine version."""

    def one(node: Node) -> str:
        p = ssh.run(
            node,
            docker_command(node, "version", "--format", "{{.Server.Version}}"),
            timeout=DOCKER_CHECK_TIMEOUT_S,
            check=False,
        )
        if p.returncode != 0 or not p.stdout.strip():
            err = " ".join(p.stderr.decode(errors="replace").split())[-200:] or f"exit {p.returncode}"
            low = err.lower()
            if p.returncode == 127 or "not found" in low and "docker" in low:
                fix = "install Docker there, or set docker = ... for it (e.g. a full path)"
            elif "permission denied" in low:
                fix = f'add {node.user or "the SSH user"} to the docker group there, or set docker = "sudo docker"'
            else:
                fix = "start the Docker daemon there (sudo systemctl start docker)"
            raise NodeError(node, f"`{node.docker}` does not work ({err}): {fix}")
        return p.stdout.decode().strip()

    return on_every_node(ssh, one)


def pull_image(ssh: SSH, image: str) -> float:
    """`docker pull` on every node at once; returns the seconds it took. A node that cannot pull is one line
    with the reason and the fix."""
    host = image.split("/", 1)[0] if "/" in image and any(c in image.split("/", 1)[0] for c in ".:") else ""

    def one(node: Node) -> None:
        p = ssh.run(node, docker_command(node, "pull", "--quiet", image), timeout=PULL_TIMEOUT_S, check=False)
        if p.returncode == 0:
            return
        err = " ".join(p.stderr.decode(errors="replace").split())[-300:] or f"exit {p.returncode}"
        raise NodeError(node, f"cannot pull {image} ({err}): {pull_fix(err, host)}")

    t0 = time.monotonic()
    on_every_node(ssh, one)
    return time.monotonic() - t0


def pull_fix(err: str, host: str) -> str:
    low = err.lower()
    registry = host or "the registry"
    if any(s in low for s in ("unauthorized", "denied", "authentication required", "forbidden")):
        if host.endswith(("-docker.pkg.dev", "gcr.io")):
            return (
                f"let the node's service account read the repository (roles/artifactregistry.reader) and run "
                f"`gcloud auth configure-docker {host}` there (VMs from dtrain up do both)"
            )
        return f"log in to {registry} on the node (docker login {host})"
    if "manifest unknown" in low or "not found" in low or "does not exist" in low:
        return "no such image or tag in the registry: check --image (dtrain build prints the reference it pushed)"
    if "http response to https client" in low:
        return f"{registry} speaks plain HTTP: add it to insecure-registries in the node's /etc/docker/daemon.json"
    if any(s in low for s in ("dial tcp", "no such host", "timeout", "connection refused", "unreachable")):
        return f"the node cannot reach {registry}: check its network route and firewall to it"
    return "see docker's message"


def check_versions(cluster: Cluster, infos: dict[str, NodeInfo]) -> None:
    """Python and torch must match the master's on every node (pickled objects and collectives cross)."""
    m = cluster.master
    for node in cluster.nodes[1:]:
        for what in ("python", "torch"):
            want, got = getattr(infos[m.name], what), getattr(infos[node.name], what)
            if want != got:
                raise NodeError(
                    node,
                    f"{what} {got} differs from the master {m.name}'s {what} {want}: "
                    "install the same version on every node",
                )


def check_port(ssh: SSH, run_id: str, server: Node, port: int, clients: Sequence[Node], what: str) -> None:
    """Every client can open a TCP connection to server:port (nothing else listening there). For a fixed port the
    clients start trying while the listener starts (a refused connection is tried again for EARLY_CONNECT_S); a
    client still refused then (the listener may have been slower) is checked again once the listener is known to be
    up, so a refusal fails the launch only from that second check. A timeout (a firewall dropping the packets) is
    the answer either way."""
    if not clients:
        return
    listener = ssh.popen(
        server,
        agent_command(server, run_id, "listen", "--addr", server.address, "--port", str(port), "--seconds", "60"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def attempt(node: Node, target: str, retry: float) -> dict[str, Any]:
        args = ["connect", "--to", target, "--timeout", str(PORT_CHECK_TIMEOUT_S), "--refused-retry", str(retry)]
        p = ssh.run(node, agent_command(node, run_id, *args), timeout=PORT_CHECK_TIMEOUT_S + retry + 60, check=False)
        try:
            return json.loads(p.stdout.decode().strip().splitlines()[-1])["results"][0]
        except (ValueError, IndexError, KeyError):
            raise NodeError(node, f"port check printed no result: {p.stderr.decode(errors='replace')[-200:]}") from None

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if port else None
    early = None
    if pool is not None:
        target = f"{server.address}:{port}"
        early = pool.submit(ssh.each, lambda n: attempt(n, target, EARLY_CONNECT_S), clients)
    try:
        first = listener.stdout.readline().decode(errors="replace")  # type: ignore[union-attr]
        try:
            state = json.loads(first)
        except ValueError:
            listener.wait(timeout=30)
            err = listener.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
            why = explain(err, server, ssh.known_hosts) if listener.returncode == 255 else err.strip()[-200:]
            raise NodeError(server, f"could not listen on port {port}: {why}") from None
        if not state.get("listening"):
            raise NodeError(
                server,
                f"{what} port {port} is not free there ({state.get('error')}): stop what uses it, or set rdzv_port",
            )
        port = state["ports"][0]  # the port the OS gave, when asked for any (0)
        target = f"{server.address}:{port}"
        known: dict[str, dict[str, Any]] = {}  # what the early tries settled: through, or not for a refusal
        if early is not None:
            with contextlib.suppress(Exception):  # a refusal, or no answer: checked again below, the listener up
                known = {name: r for name, r in early.result().items() if not r.get("refused")}

        def one(node: Node) -> None:
            result = known.get(node.name) or attempt(node, target, 0.0)
            if not result["ok"]:
                raise UserError(
                    f"node {node.name} cannot reach {server.name} ({target}) on TCP port {port}, the {what} port "
                    f"({result['error']}): open it between the nodes (firewall, iptables, security group)"
                )

        ssh.each(one, clients)
    finally:
        with contextlib.suppress(OSError):
            listener.stdin.close()  # type: ignore[union-attr]  # the listener exits on EOF, freeing the port
        try:
            listener.wait(timeout=15)
        except subprocess.TimeoutExpired:
            listener.kill()
            listener.wait()
        if pool is not None:
            pool.shutdown(wait=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeWork:
    """What node_spec starts on a node, as data: a user's program and a built-in (launchers.Plan, through
    remote_program.program_spec), `dtrain eval`'s one process and doctor's all-reduce differ only in these."""

    tail: Sequence[str]  # under torchrun: `-m MODULE ARGS` or `SCRIPT ARGS`; else the command's whole argv
    torchrun: bool = True  # a command is started once per node, its process group signalled as one
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the job's, over the cluster's
    max_restarts: int = 0
    grace_s: float = jobenv.STOP_GRACE_S
    hang: Mapping[str, Any] = dataclasses.field(default_factory=lambda: hang_spec(None))
    files: Mapping[str, Any] | None = None  # nodeagent.JobFiles: the checkpoint directory put back and copied
    cwd: str = "."  # relative to the node's run directory
    mounts: Sequence[tuple[str, str]] = ()  # container mode: node paths the arguments name, path -> ro | rw
    run_url: str = ""
    debug: bool = False
    sample_interval: float = 0.0  # resource curves (dtrain.common.resources): seconds between rows; 0: none


def node_spec(
    cluster: Cluster, node: Node, work: NodeWork, *, run_id: str, nproc: int, threads: int, gpus: int = 0
) -> dict[str, Any]:
    """The one builder of what `nodeagent run` starts on `node` (paths relative to the node's run directory):
    torchrun (common.launch.torchrun_argv, the rendezvous on the master) or a command, with the job's
    environment. With cluster.image, a container in which an agent runs this spec itself
    (nodeagent.program_container; `gpus`: the node's, for --gpus all); node.python is then the image's."""
    master = cluster.master
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        # dtrain's own workloads (dtrain.common.workload) print plain lines, and their progress as lines the
        # launcher draws its bar from (NodeAgents); a user's program does not read these.
        "DTRAIN_INTERNAL_TTY": "0",
        "DTRAIN_INTERNAL_PROGRESS": "1",
        **{k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)},
        **cluster.env,
        **work.env,
    }
    # Without an `interface`, the agent finds the one that holds the node's address (nodeagent.socket_interface).
    if node.interface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = node.interface
    if work.debug:
        env["DTRAIN_DEBUG"] = "1"
    else:  # c10d's warnings (reverse DNS of peers, ...) are noise here
        env["TORCH_CPP_LOG_LEVEL"] = env.get("TORCH_CPP_LOG_LEVEL", "ERROR")
    argv = list(work.tail)
    if work.torchrun:
        argv = torchrun_argv(
            node.python, argv, nproc=nproc, run_id=run_id, max_restarts=work.max_restarts, nnodes=len(cluster.nodes),
            master=f"{master.address}:{cluster.rdzv_port}", is_host=node.name == master.name,
            join_timeout=cluster.rdzv_timeout, local_addr=node.address,
        )  # fmt: skip
    spec = {
        "argv": argv,
        "env": env,
        "cwd": work.cwd,
        "grace_s": work.grace_s,
        "ifname_for": node.address,
        "signal_group": not work.torchrun,
        # The job's Python first on PATH: `python`, and the tools its virtualenv installed (accelerate, deepspeed).
        "path_prepend": str(Path(node.python).parent) if "/" in node.python else "",
        "hang": dict(work.hang),
        "resources": {"interval_s": work.sample_interval},
    }
    if work.files is not None:
        spec["files"] = dict(work.files)
    if not cluster.image:
        return spec
    from dtrain.common.nodeagent import program_container

    return program_container(spec, image=cluster.image, run_id=run_id, node=node.name,
                             docker=shlex.split(node.docker), gpus=gpus > 0, run_url=work.run_url,
                             mounts=work.mounts)  # fmt: skip


def hang_spec(timeout: float | None, startup: float | None = None) -> dict[str, Any]:
    """The agent's hang detection (dtrain.common.progress): its timeout (None: from the step time, 0: off), and
    the start-up bound (None: progress.STARTUP_TIMEOUT_S, 0: none of its own)."""
    return {"timeout_s": timeout} if startup is None else {"timeout_s": timeout, "startup_s": startup}


def node_paths(args: dict[str, Any], run_url: str) -> dict[str, str]:
    """Absolute paths the workload's arguments name (data, model, a shared-filesystem output), to be
    mounted at the same place in the container: path -> "ro" | "rw"."""
    out: dict[str, str] = {}
    for key, mode in PATH_ARGS.items():
        value = args.get(key)
        if isinstance(value, str) and value.startswith("/") and not is_remote(value):
            out[value.rstrip("/") or "/"] = mode
    resume = args.get("resume")
    if isinstance(resume, str) and resume.startswith("/") and not is_remote(run_url):
        out[str(Path(resume).parent)] = "rw"
    return out


class LogFiles:
    """Per-node log files: written live to a local staging directory, and appended to the run's
    logs/<node>.log every LOG_SYNC_S from a background thread (the run may live in a bucket), so
    `dtrain logs RUN -f` and the dashboard see a node's lines within seconds. Nothing is uploaded
    before the run has its config.json: a job refused for bad input leaves no run behind."""

    def __init__(self, run_id: str, run: Store) -> None:
        self.dir = logs_cache_dir(run_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self._files: dict[str, IO[str]] = {}
        # Bytes of each local file already in the run: what an earlier launch of this run wrote
        # from this machine went up then.
        self._synced = {p.name: p.stat().st_size for p in self.dir.glob("*.log")}
        self._started = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sync_periodically, name="log-sync", daemon=True)
        self._thread.start()

    def write(self, node: str, line: str) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        with self._lock:
            f = self._files.get(node)
            if f is None:
                f = self._files[node] = (self.dir / f"{node}.log").open("a", encoding="utf-8")
            f.write(f"{stamp} {line}\n")
            f.flush()

    def sync(self) -> None:
        """Append what the local files gained since the last sync to the run's logs/."""
        if not self._started:
            self._started = self.run.exists("config.json")
            if not self._started:
                return
        for path in sorted(self.dir.glob("*.log")):
            done = self._synced.get(path.name, 0)
            with path.open("rb") as f:
                f.seek(done)
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only: a line being written waits for the next sync
            if end:
                self.run.append_bytes(f"logs/{path.name}", data[:end])
                self._synced[path.name] = done + end

    def _sync_periodically(self) -> None:
        while not self._stop.wait(LOG_SYNC_S):
            with contextlib.suppress(Exception):  # retried at the next tick, and at close
                self.sync()

    def close(self, run: Store | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout=LOG_SYNC_S + 60)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
        with contextlib.suppress(Exception):
            self.sync()
            # A workload refused for bad input deletes its fresh run; lines uploaded meanwhile go too.
            if self._started and not self.run.exists("config.json"):
                self.run.delete("logs")


def logs_cache_dir(run_id: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtrain" / "logs" / run_id


class NodeAgents:
    """The agents of one job, one per node: their output, stop requests and exit codes."""

    def __init__(
        self,
        ssh: SSH,
        cluster: Cluster,
        run_id: str,
        specs: dict[str, dict],
        logs: LogFiles | None,
        *,
        events: Events,
        handle: Handle,
        echo: bool = True,
        tail: int = 0,
        resources: Recorder | None = None,
    ) -> None:
        self.resources = resources  # where the agents' "resources" lines go (dtrain.common.resources)
        self.ssh, self.cluster, self.run_id, self.specs, self.logs = ssh, cluster, run_id, specs, logs
        self.events, self.handle = events, handle
        self.echo = echo  # False: keep the lines in .output instead of reporting them
        self.output: list[tuple[str, str]] = []
        self.tail_n = tail  # keep each node's last `tail` lines, for report_failure
        self.tails: dict[str, collections.deque[str]] = {}
        self.terminated = False  # a TERMINATE reached the job (a stop asked for, not a failure)
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.procs: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.first_failure: tuple[str, int] | None = None
        self.interrupted = False
        self._kill_at = float("inf")
        self.hang: dict[str, Any] | None = None  # the first hang reported (an agent's event), or a silent agent's
        self._heard: dict[str, float] = {}  # node -> when its agent last printed a line
        self._silent_after: dict[str, float] = {}  # node -> its agent's hang timeout, from its "alive" lines
        self._stragglers = StragglerSet()  # from the agents' "alive" lines

    def run(self) -> int:
        try:
            self._start()
            return self._supervise()
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _start(self) -> None:
        for node in self.cluster.nodes:
            p = self.ssh.popen(
                node,
                agent_command(node, self.run_id, "run"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self.procs[node.name] = p
            if self.logs is not None:
                self.logs.write(node.name, f"dtrain: job started on {node.describe()} in {run_dir(node, self.run_id)}")
            # A connection that ended at once (ssh refused, a node gone) has closed its end: the write fails, and
            # its exit code, taken like any other node's, says what happened.
            try:
                p.stdin.write((json.dumps(self.specs[node.name]) + "\n").encode())  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except BrokenPipeError:
                with contextlib.suppress(OSError):  # its unsent bytes dropped with it
                    p.stdin.close()  # type: ignore[union-attr]
            threading.Thread(target=self._read, args=(node.name, p), daemon=True).start()

    def _read(self, name: str, p: subprocess.Popen) -> None:
        for raw in p.stdout:  # type: ignore[union-attr]
            self.lines.put((name, raw.decode(errors="replace").rstrip("\r\n")))
        self.lines.put((name, None))

    def _send(self, word: str) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    p.stdin.write(f"{word}\n".encode())  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]

    def _supervise(self) -> int:
        open_streams = set(self.procs)
        hard_stop_at = float("inf")
        # Ended when every stream closed and every node's code was taken: a condition on what was taken, not a
        # fresh poll (a node that ended after the last look would otherwise leave without its code).
        while open_streams or len(self.codes) < len(self.procs):
            self._handle_stops()
            try:
                name, line = self.lines.get(timeout=0.2)
            except queue.Empty:
                name, line = "", ""
            if name and line is None:
                open_streams.discard(name)
            elif name:
                self._heard[name] = time.monotonic()
                self._show(name, line)
            self._check_silent(open_streams)
            self._take_codes()
            now = time.monotonic()
            if now > self._kill_at:
                self._send("KILL")
                self._kill_at, hard_stop_at = float("inf"), now + 10
            if now > hard_stop_at:  # an agent that does not answer: drop its connection
                for p in self.procs.values():
                    if p.poll() is None:
                        p.kill()
                hard_stop_at = float("inf")
        return self._code()

    def _take_codes(self) -> None:
        """Each node whose connection ended since the last look: its exit code, and the first failure."""
        for n, p in self.procs.items():
            if n not in self.codes and p.poll() is not None:
                self.codes[n] = p.returncode
                if p.returncode != 0 and self.first_failure is None and not self.interrupted:
                    self.first_failure = (n, p.returncode)
                    if p.returncode == 255:
                        self._say(f"lost the SSH connection to node {n}")
                    if any(q.poll() is None for q in self.procs.values()):
                        self._kill_at = min(self._kill_at, time.monotonic() + FAIL_FAST_GRACE_S)

    def _handle_stops(self) -> None:
        for stop in self.handle.take():
            now = time.monotonic()
            if stop == Stop.KILL:
                self.interrupted = True
                self._send("KILL")
            elif stop == Stop.INTERRUPT:
                self.interrupted = True
                self._say("interrupted: stopping the job on every node")
                self._send("INT")
                self._kill_at = min(self._kill_at, now + INT_GRACE_S)
            else:
                self.terminated = True
                self._say("SIGTERM: the job checkpoints and stops on every node")
                self._send("TERM")
                self._kill_at = min(self._kill_at, now + jobenv.STOP_GRACE_S)

    def _code(self) -> int:
        if self.interrupted:
            return int(ExitCode.INTERRUPTED)
        if self.first_failure is not None:
            _name, rc = self.first_failure
            keep = (int(ExitCode.USAGE), int(ExitCode.PREEMPTED), int(ExitCode.HUNG))
            return rc if rc in keep else int(ExitCode.FAILURE)
        nonzero = [c for c in self.codes.values() if c != 0]
        return nonzero[0] if nonzero else 0

    def _say(self, message: str) -> None:
        self.events.info(f"dtrain: {message}")

    def _record(self, kind: str, message: str, **fields: Any) -> None:
        """A row of the run's events.jsonl (best effort), for an event just emitted."""
        from dtrain.common.metrics import record_event

        if self.logs is not None:
            row = {k: v for k, v in fields.items() if k != "step"}
            record_event(self.logs.run, fields.get("step"), kind, message, **row)

    def _stop_for_hang(self, name: str) -> None:
        if self.first_failure is None and not self.interrupted:
            self.first_failure = (name, int(ExitCode.HUNG))
        self._send("TERM")  # the hung node's agent is stopping its own job; the others wait in a collective
        self._kill_at = min(self._kill_at, time.monotonic() + HANG_GRACE_S)

    def _on_hang(self, name: str, ev: dict[str, Any]) -> None:
        """A node's agent found a hung rank: its stacks into the run (hangs/<node>-rank<r>.txt), one line that
        names them, a "hang" event, and the job stopped everywhere."""
        if self.hang is not None:
            return
        from dtrain.common.progress import hang_report

        run = self.logs.run if self.logs is not None else None
        line, facts, files = hang_report(run.url if run is not None else "", name, ev)
        self.hang = {**facts, "line": ev.get("line")}  # "line": the agent's own, which _show drops
        for rel, text in files.items() if run is not None else ():
            try:
                run.write_bytes(rel, text.encode())
            except Exception:  # noqa: BLE001 - the line must come out, whatever the store says
                if rel.endswith(f"-rank{ev.get('rank')}.txt"):
                    facts["stacks"] = self.hang["stacks"] = f"the agent's hangs/ on {name}"
                    line = line.rsplit("; stacks in ", 1)[0] + f"; stacks in {facts['stacks']}"
        self.events.emit("hang", line, **facts)
        self._record("hang", line, **facts)
        self._stop_for_hang(name)

    def hang_error(self) -> str:
        """What the run's status.json says of a job stopped for a hang ("" if none was found)."""
        from dtrain.common.progress import hang_error

        return hang_error(self.hang) if self.hang is not None else ""

    def _on_alive(self, name: str, ev: dict[str, Any]) -> None:
        with contextlib.suppress(TypeError, ValueError):
            self._silent_after[name] = float(ev.get("timeout_s") or 0)
        medians = ev.get("medians")
        if not isinstance(medians, dict):
            return
        message = self._stragglers.update(name, medians)
        if message is not None:
            now = self._stragglers.now
            self.events.emit("straggler", message, stragglers=now)
            self._record("straggler", message, stragglers=now)

    def _check_silent(self, open_streams: set[str]) -> None:
        """A node whose agent printed nothing for its hang timeout (it prints "alive" every few seconds):
        taken for hung. Only agents that said "alive" once are judged (older agents, and hang detection off)."""
        if self.hang is not None or self.interrupted or self.first_failure is not None:
            return
        now = time.monotonic()
        for name, after in self._silent_after.items():
            limit = max(SILENT_FLOOR_S, after)
            if name in open_streams and after > 0 and now - self._heard.get(name, now) > limit:
                from dtrain.common.progress import silent_line

                line = silent_line(name, limit)
                self.hang = {"node": name, "silent_s": round(now - self._heard[name], 1)}
                self.events.emit("hang", line, node=name, silent_s=self.hang["silent_s"])
                self._record("hang", line, node=name, silent_s=self.hang["silent_s"])
                self._stop_for_hang(name)
                self.procs[name].kill()  # its SSH connection: the agent does not answer
                open_streams.discard(name)  # and what it may still print is not waited for
                return

    def report_failure(self, events: Events) -> None:
        """One event naming the node that failed first, its exit code, and its last lines."""
        if self.first_failure is None:
            return
        name, rc = self.first_failure
        last = list(self.tails.get(name, ()))
        events.emit(
            "failed",
            f"dtrain: node {name} failed first (exit {rc}); its last lines:\n" + "\n".join(f"  {x}" for x in last),
            node=name,
            exit_code=rc,
            last_lines=last,
        )

    def _show(self, name: str, line: str) -> None:
        if line.startswith(CONTROL_PREFIX):
            with contextlib.suppress(ValueError):
                ev = json.loads(line[len(CONTROL_PREFIX) :])
                if isinstance(ev, dict) and ev.get("event") == "hang":
                    self._on_hang(name, ev)
                elif isinstance(ev, dict) and ev.get("event") == "alive":
                    self._on_alive(name, ev)
                elif isinstance(ev, dict) and ev.get("event") == RESOURCES_EVENT and self.resources is not None:
                    self.resources.add(name, {k: v for k, v in ev.items() if k != "event"})
            return
        if line.startswith(PROGRESS_PREFIX):
            with contextlib.suppress(ValueError):
                ev = json.loads(line[len(PROGRESS_PREFIX) :])
                if isinstance(ev, dict):
                    self.events.emit("progress", **ev)
            return
        if self.logs is not None:
            self.logs.write(name, line)
        if self.hang is not None and line == self.hang.get("line"):
            return  # the agent's hang line, for Slurm's log: the launcher has said it, naming the run's file
        if self.tail_n:
            self.tails.setdefault(name, collections.deque(maxlen=self.tail_n)).append(line)
        if not self.echo:
            self.output.append((name, line))
            return
        self.events.emit("output", line, node=name)


__all__ = ["code_archive", "check_port", "node_infos", "sync_code", "NodeAgents"]
