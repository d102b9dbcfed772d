"""What dtrain runs on each node over SSH, from the code it synced there. Standard library only
until a job starts, so `info` also works where torch is missing and says so.

    python -m dtrain.common.nodeagent info [--workdir DIR] [--addr A]   one JSON line: versions, CPUs, GPUs, disk,
                                                                   the interface holding A
    python -m dtrain.common.nodeagent listen --addr A --port P [--port P2 ...] --seconds S
    python -m dtrain.common.nodeagent connect --to HOST:PORT [--to ...] [--timeout S]
    python -m dtrain.common.nodeagent run                       a job: its spec as one JSON line on stdin

In container mode (the spec has a "container" table) `run` starts `docker run --rm --name <name> ... IMAGE
<torchrun args>` instead, with the job's environment passed as `-e NAME` (the values sit in the
environment of the docker client process, never on its command line), and stops the container by name
(`docker kill`, `docker rm -f`), so no container outlives the agent either.

`run` starts the spec's argv (torchrun through dtrain.common.launch) in a session of its own, with
its output going straight to SSH, then reads stdin for control lines: INT, TERM or KILL is sent to
the job's whole process tree. Every few seconds (the spec's "resources") it prints a "resources" control
line: the node's CPU, memory and GPUs, and each rank's memory (dtrain.common.resources). When stdin closes
(the launcher went away, or its SSH connection died), the job is stopped: SIGTERM, then SIGKILL after the
spec's grace period. When the job ends, anything it left behind is killed, so no process outlives the agent.
The agent exits with the job's exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTROL_PREFIX = "\x02dtrain-agent "  # lines the launcher reads instead of printing
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}
DEFAULT_GRACE_S = 45.0  # = jobenv.STOP_GRACE_S (this module also runs copied alone: it imports no sibling)
WATCH_EVERY_S = 1.0  # the ranks' progress is looked at this often (dtrain.common.progress)
ALIVE_EVERY_S = 5.0  # an "alive" control line this often (at most): the launcher takes a silent agent for hung
STACKS_WAIT_S = 3.0  # how long the hung ranks get to write their stacks before the job is stopped anyway
HANG_GRACE_S = 5.0  # a hung job: SIGTERM, then SIGKILL this much later (there is nothing to save)
# Every rank of the job on this node exited 0, but the process that started them (torchrun) has not: it is stopped
# this much later, and the job's exit code on this node is the ranks' 0. A launcher that reaps its ranks (a live
# torchrun in its exit barrier, waiting for the other nodes) is left alone: torchrun bounds that wait itself.
RANKS_ENDED_WAIT_S = 30.0


# What `info --cached` keeps between launches: importing torch to learn its version takes a second or more,
# and a warm launch should not pay it on every node every time.
TORCH_FIELDS = ("torch", "cuda", "gpus", "nccl")


def info_cached(workdir: str, address: str = "") -> dict[str, Any]:
    """info(), with the torch part (version, CUDA, GPUs, NCCL) reused from the last call while torch's files,
    this interpreter, CUDA_VISIBLE_DEVICES and the GPUs nvidia-smi lists are unchanged."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return info(workdir, address)
    smi = shutil.which("nvidia-smi")
    listed = ""
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    st = os.stat(spec.origin)
    key = hashlib.sha256(
        json.dumps(
            [
                sys.executable,
                sys.prefix,
                spec.origin,
                st.st_mtime_ns,
                st.st_size,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
                listed,
            ]
        ).encode()  # fmt: skip
    ).hexdigest()[:16]
    cache = Path(os.path.expanduser(workdir or ".")) / ".cache" / f"info-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        torch_part = json.loads(cache.read_text())
        out = info(workdir, address, with_torch=False)
        out.update({k: torch_part[k] for k in TORCH_FIELDS if k in torch_part})
        return out
    out = info(workdir, address)
    if out.get("torch"):
        with contextlib.suppress(OSError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: out.get(k) for k in TORCH_FIELDS}))
            os.replace(tmp, cache)
    return out


def info(workdir: str, address: str = "", *, with_torch: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "hostname_resolves_to": _resolve(socket.gethostname()),
        "python": platform.python_version(),
        "executable": sys.executable,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    wd = Path(os.path.expanduser(workdir or "."))
    wd.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(wd)
    out["disk_free_bytes"], out["disk_total_bytes"], out["workdir"] = usage.free, usage.total, str(wd.resolve())
    if address:
        out["address"], out["ifname"] = address, interface_of(address)
    if not with_torch:
        return out
    try:
        import torch
    except ImportError as e:
        # Container mode needs no torch here: count the GPUs the way the container will see them.
        out["torch"], out["torch_error"] = None, str(e)
        out["gpus"] = smi_gpus()
        return out
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append({"name": torch.cuda.get_device_name(i), "free_bytes": free, "total_bytes": total})
    out["gpus"] = gpus
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if gpus else None
    return out


def _resolve(host: str) -> list[str]:
    with contextlib.suppress(OSError):
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    return []


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (an IP, or a name that resolves to this node's IPs), or None.

    gloo and NCCL otherwise pick the address the node's own hostname resolves to, which Debian and
    Ubuntu map to 127.0.1.1 in /etc/hosts: the peers are then told to connect to loopback."""
    wanted = set(_resolve(address)) or {address}
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=10, check=True)
        for link in json.loads(out.stdout):
            if any(a.get("local") in wanted for a in link.get("addr_info", [])):
                return link.get("ifname")
        return None
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    # No iproute2: each interface's primary IPv4 address (SIOCGIFADDR).
    import fcntl
    import struct

    for _index, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            if socket.inet_ntoa(packed[20:24]) in wanted:
                return name
    return None


def socket_interface(spec: dict[str, Any]) -> None:
    """Point gloo and NCCL at the interface that carries the node's cluster address (`ifname_for`),
    unless the spec's environment names one already (the inventory's `interface`)."""
    env = spec.setdefault("env", {})
    address = spec.get("ifname_for")
    if not address or env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME"):
        return
    name = interface_of(address)
    if name:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = name
    else:
        print(f"dtrain: warning: no interface of this node holds {address}; gloo/NCCL pick their own", flush=True)


def smi_gpus() -> list[dict[str, Any]]:
    """GPUs as nvidia-smi lists them (no torch needed); [] without nvidia-smi or a driver."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    query = ["--query-gpu=name,memory.free,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            gpus.append({"name": parts[0], "free_bytes": int(parts[1]) << 20, "total_bytes": int(parts[2]) << 20})
    return gpus


def listen(addr: str, ports: list[int], seconds: float) -> int:
    """Accept connections on each port for `seconds`, or until stdin closes (the caller is done, or gone: the
    ports are freed at once, for the job that is about to bind them); prints one JSON line once all are bound."""
    import selectors

    socks = []
    for p in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, p))
        except OSError as e:
            print(json.dumps({"listening": False, "port": p, "error": e.strerror or str(e)}), flush=True)
            return 1
        s.listen(64)
        socks.append(s)
    print(json.dumps({"listening": True, "ports": [s.getsockname()[1] for s in socks]}), flush=True)
    closed, wake = socket.socketpair()  # stdin's EOF (whatever stdin is) wakes the loop below at once

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdin.buffer.read()
        wake.close()

    threading.Thread(target=watch, daemon=True).start()
    sel = selectors.DefaultSelector()
    for s in (*socks, closed):
        sel.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            if key.fileobj is closed:
                deadline = 0
            else:
                with contextlib.suppress(OSError):
                    key.fileobj.accept()[0].close()  # type: ignore[union-attr]
    for s in socks:
        s.close()
    return 0


def connect(targets: list[str], timeout: float, refused_retry: float = 0.0) -> int:
    """Try a TCP connection to each HOST:PORT; one JSON line with the results. A refused connection is tried
    again for up to `refused_retry` seconds (the listener may still be starting)."""
    results = []
    for t in targets:
        host, _, port = t.rpartition(":")
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=timeout).close()
                results.append({"to": t, "ok": True, "ms": round((time.monotonic() - t0) * 1000, 1)})
            except ConnectionRefusedError as e:
                if time.monotonic() - t0 < refused_retry:
                    time.sleep(0.05)
                    continue
                results.append({"to": t, "ok": False, "error": e.strerror or str(e), "refused": True})
            except OSError as e:
                reason = "timed out" if isinstance(e, (TimeoutError, socket.timeout)) else (e.strerror or str(e))
                results.append({"to": t, "ok": False, "error": reason})
            break
    print(json.dumps({"results": results}), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun's workers run in sessions of their own, so a process
    group does not reach them)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


class EndedRanks:
    """Whether the job's ranks on this node have all exited 0 while their launcher lives on, unable to reap them
    (frozen, or stuck): `update(pids)` every poll, with the job's process tree; True once that has lasted
    `wait_s`. A rank is a process that carries RANK in its environment and whose parent does not (learnt while
    it runs: a zombie's environment cannot be read); a zombie's exit status is in /proc/<pid>/stat (field 52)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.ranks: set[int] = set()
        self.since: float | None = None  # when every rank was first seen exited 0

    @staticmethod
    def _stat(pid: int) -> list[str] | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on
        except (OSError, IndexError):
            return None

    @staticmethod
    def _has_rank(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return any(item.startswith(b"RANK=") for item in f.read().split(b"\0"))
        except OSError:
            return False

    def update(self, pids: list[int], now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        for pid in pids:
            if pid not in self.ranks and self._has_rank(pid):
                fields = self._stat(pid)
                if fields is not None and not self._has_rank(int(fields[1])):
                    self.ranks.add(pid)
        stats = [self._stat(pid) for pid in self.ranks]
        # A zombie that exited 0: state Z, and a wait status of 0 (field 52: index 49 from field 3).
        done = bool(stats) and all(st is not None and st[0] == "Z" and len(st) > 49 and st[49] == "0" for st in stats)
        if not done:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.wait_s


def signal_tree(pid: int, sig: int, *, only_root: bool = False) -> None:
    for p in [pid] if only_root else tree(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def container_argv(c: dict[str, Any], env_names: list[str], workdir: Path, uid: int, gid: int) -> list[str]:
    """`docker run` for the container spec `c` (see the module docstring). Mount sources relative to the
    node's workdir are made absolute here; the job's environment goes by name only."""
    argv = [*c["docker"], "run", "--rm", "--name", c["name"], "--init", "--network", "host"]
    argv += ["--ipc", "host"] if c.get("ipc_host", True) else ["--shm-size", c.get("shm_size", "8g")]
    if c.get("gpus"):
        argv += ["--gpus", "all"]
    # dockerd stops a container (VM shutdown, `docker stop` without -t) with SIGTERM, then SIGKILL after this
    # many seconds; its default, 10 s, would cut the last checkpoint short of GCE's 30 s preemption notice
    # (docs/preemption.md). A spec may ask for another budget.
    argv += ["--stop-timeout", str(int(c.get("stop_timeout_s", 30)))]
    if uid != 0 or c.get("user") == "host":
        # Files on the mounted volumes belong to the node's user, as in synced mode. As root, a built-in runs
        # as the image's own (non-root) user, and the run's directories are handed to it (prepare_mounts);
        # a user's program (user = "host") runs as the agent's user: its files are the user's project's.
        argv += ["--user", f"{uid}:{gid}", "-e", "HOME=/tmp"]
    for src, dst, mode in c.get("mounts", []):
        path = Path(os.path.expanduser(src))
        path = path if path.is_absolute() else workdir / path
        argv += ["-v", f"{path}:{dst or path}:{mode}"]  # no destination: the same path inside
    if c.get("cwd"):
        argv += ["-w", str(workdir / c["cwd"])]  # relative: a folder of the workdir, mounted at the same path
    for name in env_names:
        argv += ["-e", name]
    if c.get("entrypoint"):
        argv += ["--entrypoint", c["entrypoint"]]
    return [*argv, c["image"], *c["args"]]


# Folders of a node's workdir that every job container has (the image's caches and its data mount point).
CONTAINER_MOUNTS = (("cache", "/cache", "rw"), ("hf-cache", "/hf-cache", "rw"), ("data", "/data", "ro"))
# A user's program in a container: the agent inside gets its spec through this variable, and has the grace
# period and then the last copy of the checkpoint directory to make: the agent outside waits this much longer.
INNER_SPEC_ENV = "DTRAIN_INTERNAL_AGENT_SPEC"
CONTAINER_FINAL_COPY_S = 30.0


def job_container_name(run_id: str, node: str) -> str:
    """dtrain-<run>-<node>: what the agent (and a person) stops a job's container by."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"dtrain-{run_id}-{node}")


def run_folder_mount(run_url: str) -> list[list[str]]:
    """The mount a job container needs for a run kept in a folder (a shared filesystem): the runs' folder at its
    own path, read-write; none for a bucket's run."""
    if not run_url or "://" in run_url:
        return []
    return [[os.path.dirname(os.path.abspath(run_url)), "", "rw"]]


def program_container(
    inner: dict[str, Any],
    *,
    image: str,
    run_id: str,
    node: str,
    docker: list[str],
    gpus: bool,
    run_url: str = "",
    mounts: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Container mode for a user's program (the SSH launcher's and Slurm's node steps alike): this agent
    starts `docker run IMAGE python3 -m dtrain.common.nodeagent run --spec-env ...`, and the agent inside runs
    `inner` (the synced-mode spec) itself: it puts the checkpoint directory back, starts the program, copies
    the directory with the image's storage client (the node itself may have none), forwards the metrics, and
    stops the program on the container's SIGTERM (its grace period, then the last copy).

    The run's directory (this agent's cwd, <workdir>/runs/<run id>: the code snapshot in work/, dtrain's synced
    code, the checkpoint directory) and the image's environments (<workdir>/envs) are mounted at the paths they
    have on the node, so every path in `inner` (a virtualenv's python included) means the same inside. The
    job's environment reaches the container by name only (-e NAME), and `inner` travels in one more such
    variable, so no value is on a command line. The program runs as this agent's user (its files are that
    user's, not the image's). A run kept in a folder (`run_url` not gs://: a shared filesystem) has that
    folder's parent, the runs' folder, mounted at its own path too: the agent inside copies checkpoints there.
    `mounts`: more node paths the job's arguments name (path, "ro" | "rw"), each at its own path (one that is
    mounted already is not mounted twice, and one of the image's folders, /data say, gives way to it: docker
    refuses two mounts at one place)."""
    env = dict(inner.get("env", {}))
    own = run_folder_mount(run_url)
    taken = {m[0] for m in own}
    named = {path for path, _ in mounts}  # a path the job names wins over an image folder mounted there
    inner = {**inner, "env": {}}
    env[INNER_SPEC_ENV] = json.dumps(inner)
    container = {
        "image": image,
        "name": job_container_name(run_id, node),
        "docker": list(docker),
        "workdir": "../..",  # the agent runs in <workdir>/runs/<run id>
        "cwd": f"runs/{run_id}",
        "mounts": [
            [f"runs/{run_id}", "", "rw"],
            ["envs", "", "ro"],
            *[list(m) for m in CONTAINER_MOUNTS if m[1] not in named],
            *own,
            *[[path, "", mode] for path, mode in mounts if path not in taken],
        ],
        "pythonpath": [f"runs/{run_id}/code"],
        "user": "host",
        "gpus": bool(gpus),
        "entrypoint": "python3",
        "args": ["-m", "dtrain.common.nodeagent", "run", "--spec-env", INNER_SPEC_ENV],
    }
    grace = float(inner.get("grace_s") or DEFAULT_GRACE_S) + CONTAINER_FINAL_COPY_S
    out = {"argv": None, "env": env, "grace_s": grace, "container": container}
    if inner.get("ifname_for"):
        out["ifname_for"] = inner["ifname_for"]
    return out


def prepare_mounts(c: dict[str, Any], workdir: Path, uid: int) -> None:
    """Create the writable mount sources under the workdir; as root, give them to the image's user."""
    owner = None
    if uid == 0 and c.get("user") != "host":
        p = subprocess.run(
            [*c["docker"], "image", "inspect", "--format", "{{.Config.User}}", c["image"]],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        user = p.stdout.strip().split(":")
        if p.returncode == 0 and user[0].isdigit():
            owner = (int(user[0]), int(user[1]) if len(user) > 1 and user[1].isdigit() else int(user[0]))
    for src, _dst, mode in c.get("mounts", []):
        path = Path(os.path.expanduser(src))
        if path.is_absolute():
            continue  # a path the user named: theirs to provide
        path = workdir / path
        path.mkdir(parents=True, exist_ok=True)
        if owner is not None and mode == "rw":
            with contextlib.suppress(OSError):
                os.chown(path, *owner)


def docker_quiet(c: dict[str, Any], *args: str) -> int:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            [*c["docker"], *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False
        ).returncode
    return -1


def run_container(spec: dict[str, Any]) -> int:
    """The job in a container: started with `docker run`, signalled and removed by name."""
    c, grace = spec["container"], float(spec.get("grace_s", DEFAULT_GRACE_S))
    workdir = Path(c.get("workdir") or ".").expanduser().resolve()
    uid, gid = os.getuid(), os.getgid()
    docker_quiet(c, "rm", "--force", c["name"])  # a container left by an earlier attempt of this run
    prepare_mounts(c, workdir, uid)
    if c.get("pythonpath"):  # folders of the workdir (mounted at the same path) first on the job's PYTHONPATH
        job_env = spec.setdefault("env", {})
        paths = [str(workdir / p) for p in c["pythonpath"]]
        job_env["PYTHONPATH"] = os.pathsep.join([*paths, job_env["PYTHONPATH"]] if job_env.get("PYTHONPATH") else paths)
    env = {**os.environ, **spec.get("env", {})}
    argv = container_argv(c, sorted(spec.get("env", {})), workdir, uid, gid)
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    done = threading.Event()

    def kill(sig: str) -> None:
        if docker_quiet(c, "kill", "--signal", sig, c["name"]) != 0 and sig == "KILL":
            signal_tree(proc.pid, signal.SIGKILL)  # no container (yet): stop the client creating it

    def watch_stdin() -> None:
        for raw in sys.stdin:
            word = raw.strip()
            if word in SIGNALS:
                kill(word)
        if not done.is_set():  # stdin closed: the launcher is gone. Stop the container, then make sure.
            kill("TERM")
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            kill("KILL")

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(CONTROL_PREFIX + json.dumps({"event": "started", "pid": proc.pid, "container": c["name"]}), flush=True)
    code = proc.wait()
    done.set()
    docker_quiet(c, "rm", "--force", c["name"])  # --rm does it when the container ran; this covers the rest
    return code if code >= 0 else 128 - code


class JobFiles:
    """A user program's files on this node (the spec's "files" table): its checkpoint directory, put back
    from the run's store before the program starts and copied there while it runs and once more at the
    end (dtrain.common.mirror); the SDK's metrics file, forwarded to the run; the stop file, created when a
    stop is asked for. Imports beyond the standard library happen only here, for such a job."""

    def __init__(self, files: dict[str, Any], env: dict[str, str], pids: Any) -> None:
        from dtrain.common import jobenv
        from dtrain.common.mirror import Forward, Mirror, restore
        from dtrain.common.storage import open_store

        # Paths relative to the run's directory on this node (the agent's own): the program gets them whole.
        for key, name in (("checkpoint_dir", jobenv.CHECKPOINT_DIR), ("stop_file", jobenv.STOP_FILE),
                          ("metrics_file", jobenv.METRICS_FILE), ("code_dir", jobenv.CODE_DIR)):  # fmt: skip
            if files.get(key):
                files[key] = env[name] = os.path.abspath(os.path.expanduser(files[key]))
        for f in files.get("forward", []):
            f["local"] = os.path.abspath(os.path.expanduser(f["local"]))
        self.stop_file = Path(files["stop_file"])
        self.stop_file.unlink(missing_ok=True)
        ckpt = Path(files["checkpoint_dir"])
        ckpt.mkdir(parents=True, exist_ok=True)
        self.mirror = None
        m = files.get("mirror")
        if m:
            store = open_store(m["store"])
            if m.get("restore"):
                got = restore(store, ckpt, log=_say)
                if got is not None:
                    _say(f"checkpoint directory restored from the run: {got.files} file(s), {got.bytes} bytes")
            forwards = [Forward(Path(f["local"]), open_store(f["store"]), f["rel"]) for f in files.get("forward", [])]
            self.mirror = Mirror(ckpt, store, node=int(m["node"]), interval_s=float(m.get("interval_s", 30.0)),
                                 forwards=forwards, pids=pids, log=_say)  # fmt: skip
            self.mirror.start()

    def stop_requested(self) -> None:
        with contextlib.suppress(OSError):
            self.stop_file.touch()

    def close(self, *, killed: bool) -> None:
        """The last copy: the folder as the program left it if it ended by itself; only settled files (the
        last complete copy stands) if it had to be killed, perhaps in the middle of a save."""
        if self.mirror is not None:
            self.mirror.close(final=not killed)


def _say(message: str) -> None:
    print(f"dtrain: {message}", flush=True)


def _control(event: dict[str, Any]) -> None:
    print(CONTROL_PREFIX + json.dumps(event), flush=True)


class HangWatch:
    """Hang detection for one job on this node (docs/hangs.md): the ranks' progress directory and stack
    folder, given to the job through its environment, and the Watcher that reads them. None of it when the
    spec's hang timeout is 0, or where dtrain.common.progress cannot be imported (an agent copied alone)."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        import tempfile

        from dtrain.common import progress

        opts = spec.get("hang") or {}
        self.progress = progress
        # Named after this agent's pid: what an agent killed outright (SIGKILL) left is removed by the next one.
        tmp = Path(tempfile.gettempdir())
        for old in tmp.glob("dtrain-progress-*-*"):
            pid = old.name.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(old, ignore_errors=True)
        self.dir = tempfile.mkdtemp(prefix=f"dtrain-progress-{os.getpid()}-")
        self.stacks = os.path.join(self.dir, "stacks")
        os.mkdir(self.stacks)
        env[progress.PROGRESS_DIR], env[progress.STACKS_DIR] = self.dir, self.stacks
        # sitecustomize (hangdump/) first on the job's path: every Python process of the job dumps its stacks
        # on SIGUSR1 (and then runs the sitecustomize it would have run).
        hook = os.path.join(os.path.dirname(os.path.abspath(progress.__file__)), "hangdump")
        env["PYTHONPATH"] = os.pathsep.join([hook, env["PYTHONPATH"]] if env.get("PYTHONPATH") else [hook])
        startup = opts.get("startup_s")
        self.watcher = progress.Watcher(
            self.dir, opts.get("timeout_s"), startup_s=progress.STARTUP_TIMEOUT_S if startup is None else startup
        )
        self.save_to = Path(os.path.expanduser(opts.get("stacks_dir") or "hangs"))
        self.host = socket.gethostname()

    def dump(self, ranks: list[Any]) -> dict[str, str]:
        """Each rank's Python stacks (SIGUSR1 to the ranks whose process installed the handler, SIGCONT to a
        stopped one), as text: rank -> stacks."""
        files = {}
        for rk in ranks:
            path = os.path.join(self.stacks, f"{rk.pid}.txt")
            if not os.path.exists(path):  # no handler there: SIGUSR1 would kill it
                continue
            files[rk.rank] = path
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(rk.pid, signal.SIGUSR1)
                if rk.state == "T":
                    os.kill(rk.pid, signal.SIGCONT)  # a stopped process runs the handler once continued
        deadline = time.monotonic() + STACKS_WAIT_S
        sizes: dict[str, int] = {}
        while time.monotonic() < deadline:
            now = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in files.items()}
            if all(now.values()) and now == sizes:
                break  # every file written, and no longer growing
            sizes = now
            time.sleep(0.2)
        out = {}
        for rk in ranks:
            text = ""
            if rk.rank in files:
                with contextlib.suppress(OSError):
                    text = Path(files[rk.rank]).read_text(errors="replace")
            py_spy = shutil.which("py-spy")
            if py_spy and not text:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    text = subprocess.run([py_spy, "dump", "--pid", str(rk.pid)], capture_output=True, text=True,
                                          timeout=20, check=False).stdout  # fmt: skip
            out[rk.rank] = text or f"(no Python stack: process {rk.pid} did not answer SIGUSR1)\n"
        return out

    def report(self, hang: Any) -> None:
        """Save the stuck ranks' stacks, and one line naming the host, the rank, its last step and the file."""
        rk = hang.rank
        stacks = self.dump(hang.others)
        path = self.save_to / f"{self.host}-rank{rk.rank}.txt"
        with contextlib.suppress(OSError):
            self.save_to.mkdir(parents=True, exist_ok=True)
            for r, text in stacks.items():
                (self.save_to / f"{self.host}-rank{r}.txt").write_text(text)
        line = self.progress.hang_line(self.host, rk.rank, hang.age_s, rk.step, str(path), startup=hang.startup)
        _control({"event": "hang", "host": self.host, "rank": rk.rank, "step": rk.step, "state": rk.state,
                  "age_s": round(hang.age_s, 1), "timeout_s": round(hang.timeout_s, 1), "stacks": stacks,
                  "line": line, **hang.facts()})  # fmt: skip
        print(line, flush=True)  # for a launcher that reads no control lines (Slurm's step); the Job drops it

    def timeout(self) -> float:
        """The longest hang timeout of this node's ranks (the launcher waits that long for a silent agent)."""
        w = self.watcher
        return max((w.timeout(rk) for rk in w.ranks.values()), default=w.explicit or self.progress.NO_STEP_TIMEOUT_S)

    def alive(self) -> None:
        """The line that says this agent still answers (every ALIVE_EVERY_S, or a quarter of the timeout)."""
        # "ranks": how many of the job's ranks on this node run now (0 once they have all ended: Slurm's batch step
        # then bounds how long a launcher waiting in its exit barrier may hold the job, slurmstep.NODES_ENDED_WAIT_S).
        _control({"event": "alive", "timeout_s": round(self.timeout(), 1), "medians": self.watcher.medians(),
                  "ranks": len(self.watcher.ranks)})  # fmt: skip

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def run(spec_env: str = "") -> int:
    """A job: its spec as one JSON line on stdin, and then control lines on stdin (see the module docstring).
    With `spec_env`, the spec is that environment variable instead and the job is controlled by this
    process's own SIGINT and SIGTERM: the agent inside a user's program's container (`docker kill --signal`
    reaches it through the container's init), where there is no stdin."""
    line = os.environ.pop(spec_env, "") if spec_env else sys.stdin.readline()
    if not line:
        return 2
    spec = json.loads(line)
    socket_interface(spec)
    if spec.get("container"):
        return run_container(spec)
    grace = float(spec.get("grace_s", DEFAULT_GRACE_S))
    env = {**os.environ, **spec.get("env", {})}
    # The job is not an SSH session: with SSH_CLIENT set, Debian's bash runs ~/.bashrc for every `bash -c` the
    # job starts (bash's SSH_SOURCE_BASHRC), and a conda or pyenv init there puts another Python first on PATH.
    for name in ("SSH_CLIENT", "SSH2_CLIENT", "SSH_CONNECTION", "SSH_TTY"):
        env.pop(name, None)
    if spec.get("path_prepend"):  # a job's virtualenv: its tools (accelerate, deepspeed, ...) come first
        venv_bin = os.path.abspath(os.path.expanduser(spec["path_prepend"]))
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", os.defpath)
        if os.path.exists(os.path.join(os.path.dirname(venv_bin), "pyvenv.cfg")):
            env["VIRTUAL_ENV"] = os.path.dirname(venv_bin)
    snapshot: list[int] = []
    files = None
    if spec.get("files"):
        # The agent's own storage client reads the run's store the way the job does.
        for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"):
            if spec.get("env", {}).get(name):
                os.environ[name] = spec["env"][name]
        try:
            files = JobFiles(spec["files"], env, lambda: list(snapshot))
        except Exception as e:  # noqa: BLE001 - one line for the launcher, whatever the store said
            print(f"dtrain: cannot set up the checkpoint directory's copy on {socket.gethostname()}: {e}", flush=True)
            return 1
    watch = None
    if (spec.get("hang") or {}).get("timeout_s") != 0:
        with contextlib.suppress(ImportError):  # an agent copied alone (container mode) watches nothing
            watch = HangWatch(spec, env)
    try:
        # Not the agent's stdin: that is the launcher's control channel (and, being SSH's socket, it makes a
        # `bash -c` in the job read ~/.bashrc as if sshd had started it).
        proc = subprocess.Popen(
            spec["argv"], env=env, cwd=spec.get("cwd") or None, start_new_session=True, stdin=subprocess.DEVNULL
        )
    except OSError as e:
        # A command that is not there: one line naming it and the node, and the usage exit code.
        print(f"dtrain: cannot start {spec['argv'][0]} on {socket.gethostname()}: {e.strerror or e}", flush=True)
        if files is not None:
            files.close(killed=False)
        if watch is not None:
            watch.close()
        return 2
    snapshot.append(proc.pid)

    killed: list[bool] = []  # the job had to be killed (KILL, or still running after the grace period)

    def control(sig: int) -> None:
        if sig == signal.SIGKILL and proc.poll() is None:
            killed.append(True)
        if files is not None and sig != signal.SIGKILL:
            files.stop_requested()
        # torchrun forwards INT and TERM to its workers itself; KILL must reach them all. A command
        # gets the signal as a whole session (its own launcher may not forward it).
        if spec.get("signal_group"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        signal_tree(proc.pid, sig, only_root=sig != signal.SIGKILL)

    def stop_within_grace(grace_s: float = grace) -> None:
        """Stop the job, then make sure: SIGTERM, and SIGKILL to what is left after the grace period."""
        if proc.poll() is None:
            if files is not None:
                files.stop_requested()
            signal_tree(proc.pid, signal.SIGTERM, only_root=not spec.get("signal_group"))
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                killed.append(True)
            signal_tree(proc.pid, signal.SIGKILL)

    def watch_stdin() -> None:
        for raw in sys.stdin:
            sig = SIGNALS.get(raw.strip())
            if sig is not None:
                control(sig)
        stop_within_grace()  # stdin closed: the launcher is gone

    if spec_env:
        # INT is passed on as a control line would be; the first TERM starts the grace period (a TERM from
        # the outer agent, dockerd or the VM's shutdown), after which what is left is killed.
        asked: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            if signum == signal.SIGINT:
                threading.Thread(target=control, args=(signal.SIGINT,), daemon=True).start()
            elif not asked:
                asked.append(signum)
                threading.Thread(target=stop_within_grace, daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    else:
        threading.Thread(target=watch_stdin, daemon=True).start()
    print(CONTROL_PREFIX + json.dumps({"event": "started", "pid": proc.pid}), flush=True)
    hung: list[bool] = []

    def watch_progress() -> None:
        """Every WATCH_EVERY_S: the ranks' progress; a hang is reported and the job stopped (a stopped or
        deadlocked rank no longer answers SIGTERM: SIGKILL follows soon)."""
        assert watch is not None
        alive_at = -ALIVE_EVERY_S
        while proc.poll() is None:
            try:
                hang = watch.watcher.poll(tree(proc.pid))
            except Exception as e:  # noqa: BLE001 - the watcher must never take the job down with it
                _say(f"warning: hang detection stopped on {socket.gethostname()}: {e}")
                return
            if time.monotonic() - alive_at >= min(ALIVE_EVERY_S, watch.timeout() / 4):
                alive_at = time.monotonic()
                watch.alive()
            if hang is not None and proc.poll() is None:
                hung.append(True)
                watch.report(hang)
                stop_within_grace(HANG_GRACE_S)
                return
            time.sleep(WATCH_EVERY_S)

    if watch is not None:
        threading.Thread(target=watch_progress, name="hang-watch", daemon=True).start()
    sampling = start_sampling(spec, lambda: list(snapshot))
    ended = EndedRanks(float(spec.get("ranks_ended_wait_s", RANKS_ENDED_WAIT_S)))
    launcher_stuck = False
    while proc.poll() is None:
        snapshot[:] = tree(proc.pid)  # the last view of the job's processes, to sweep at the end
        if ended.update(snapshot):
            launcher_stuck = True
            _say(f"the job's ranks on {socket.gethostname()} all exited 0 {ended.wait_s:.0f} s ago, but their "
                 "launcher has not ended: stopping it; the ranks' exit code 0 stands")  # fmt: skip
            stop_within_grace(HANG_GRACE_S)
            killed.clear()  # the ranks had ended by themselves: the folder is as they left it
            break
        time.sleep(0.5)
    for p in snapshot[1:]:  # whatever the job left behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    if sampling is not None:
        sampling.close()
    if files is not None:
        files.close(killed=bool(killed))  # the last copy of the checkpoint directory: nothing writes to it now
    if watch is not None:
        watch.close()
        if hung:
            return watch.progress.HUNG_EXIT
    if launcher_stuck:
        return 0
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def start_sampling(spec: dict[str, Any], pids: Any) -> Any:
    """Resource curves (dtrain.common.resources): a row every spec["resources"]["interval_s"] as a "resources"
    control line, which the launcher (or Slurm's batch step) records in the run. None where the spec asks for
    none (0, or a launcher from before curves) or dtrain.common.resources cannot be imported (an agent copied
    alone)."""
    interval = float((spec.get("resources") or {}).get("interval_s") or 0)
    if interval <= 0:
        return None
    try:
        from dtrain.common.resources import EVENT, SamplerThread
    except ImportError:
        return None
    return SamplerThread(interval, pids, lambda row: _control({"event": EVENT, **row}), warn=_say).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtrain.common.nodeagent")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info")
    pi.add_argument("--workdir", default=".")
    pi.add_argument("--addr", default="", help="the node's cluster address: report the interface that holds it")
    pi.add_argument("--cached", action="store_true", help="reuse torch's part from the last call (a launch's check)")
    pl = sub.add_parser("listen")
    pl.add_argument("--addr", default="0.0.0.0")
    pl.add_argument("--port", type=int, action="append", required=True)
    pl.add_argument("--seconds", type=float, default=10.0)
    pc = sub.add_parser("connect")
    pc.add_argument("--to", action="append", required=True)
    pc.add_argument("--timeout", type=float, default=3.0)
    pc.add_argument("--refused-retry", type=float, default=0.0, help="try a refused connection again this long")
    pr = sub.add_parser("run")
    pr.add_argument("--spec-env", default="", help="read the spec from this variable; control by INT and TERM")
    a = p.parse_args(argv)
    if a.cmd == "info":
        print(json.dumps((info_cached if a.cached else info)(a.workdir, a.addr)), flush=True)
        return 0
    if a.cmd == "listen":
        return listen(a.addr, a.port, a.seconds)
    if a.cmd == "connect":
        return connect(a.to, a.timeout, a.refused_retry)
    return run(a.spec_env)


if __name__ == "__main__":
    sys.exit(main())
