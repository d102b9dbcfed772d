"""A multi-host test bed on one machine: Linux network namespaces, each running a real OpenSSH server.

Each "host" ``h0``, ``h1``, ... is a network namespace with ``lo`` and an ``eth0`` (one end of a veth
pair whose other end sits on a bridge in the root namespace), its own sshd listening on
``10.213.<k>.<11+i>:22``, its own host key and a ``work/`` directory under ``<root>/<name>/``. The root
namespace holds ``10.213.<k>.1`` on the bridge, so tests reach every host directly. Namespaces have no
default route: traffic never leaves the test bed's own /24. The SSH user is root with the key
``<root>/id_ed25519``. All hosts share the machine's filesystem; only the network is separate.

Everything a test bed creates carries a per-instance prefix ``dt<4 hex>`` (namespaces ``dtXXXX-h0``,
bridge ``dtbrXXXX``, veths ``dtXXXXv0``), and a state file ``/run/dtrain-testbed/dtXXXX.json`` records
the owner's pid, so that a test bed left by a crashed run is found and removed by ``cleanup_stale()``.

Needs root, ``ip`` (iproute2), ``/usr/sbin/sshd``, ``ssh`` and ``ssh-keygen``; ``iptables`` for
``block_port``. As a library::

    with Testbed.create(2, Path("/tmp/bed")) as tb:
        tb.exec(tb.hosts[0], ["ip", "addr"])

From a shell::

    python scripts/testbed.py up --hosts 2 --dir /tmp/bed [--python PY] [--gcs]   # Ctrl-C tears down
    python scripts/testbed.py down --dir /tmp/bed        # or: down --all (every stale test bed)

``Testbed.create(n, root, hostnames=True, private=("/etc/slurm", ...))`` makes hosts that look more like
separate machines: each runs under its own hostname (its name, h0, h1, ...; /etc/hosts inside maps the other
hosts' names to their addresses) and has its own copy of each ``private`` directory (bind-mounted over the
real one for sshd and everything it starts, initially empty with the real directory's owner and mode), so
that daemons writing system paths (/etc/munge, /run/munge, ...) do not share them. ``crash(host)`` kills
every process of a host and ``revive(host)`` starts its sshd again (scripts/slurmbed.py uses these).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATE_DIR = Path("/run/dtrain-testbed")
SSHD = "/usr/sbin/sshd"
SUBNET = "10.213"
START_TIMEOUT_S = 10.0
PREFIX_RE = re.compile(r"^dt([0-9a-f]{4})(?:-h\d+|[vp]\d+)$|^dtbr([0-9a-f]{4})$")


@dataclass(frozen=True)
class Host:
    """One host of the test bed; ``address`` is its eth0 address, ``workdir`` its own working directory."""

    name: str
    address: str
    namespace: str
    dir: Path
    workdir: Path
    host_key_pub: str  # "ssh-ed25519 AAAA... comment"


def _run(*argv: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    """Runs a command (inside namespace ``ns`` if given), capturing text output; raises with stderr on failure."""
    full = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    r = subprocess.run(full, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (from /proc), or None if it is gone or a zombie; guards against pid reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _wait_listening(address: str, port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
    """Waits until ``address:port`` accepts a TCP connection from here; raises with the log's tail otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; log {log}:\n{_tail(log)}")
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                msg = f"{what} not listening on {address}:{port} after {START_TIMEOUT_S}s ({e}):\n{_tail(log)}"
                raise RuntimeError(msg) from None
            time.sleep(0.05)


def _tail(log: Path, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    return "(no log)"


@contextlib.contextmanager
def _locked():
    """Serializes creating and reaping test beds across processes (flock on a file in STATE_DIR)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


NETNS_ETC = Path("/etc/netns")


def _debian_hosts(ns: str, hostname: str = "", others: dict[str, str] | None = None) -> None:
    """/etc/hosts as Debian and Ubuntu write it, for every process `ip netns exec` starts in `ns` (it
    bind-mounts /etc/netns/<ns>/hosts over /etc/hosts): the host's hostname (default: the machine's) maps
    to 127.0.1.1, so a program that looks up its own address (gloo, NCCL) gets loopback unless told which
    interface to use. `others`: the other hosts' names and addresses, as a cluster's DNS would give them."""
    d = NETNS_ETC / ns
    d.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{hostname or socket.gethostname()}"]
    lines += [f"{address}\t{name}" for name, address in (others or {}).items()]
    (d / "hosts").write_text("\n".join(lines) + "\n")


def _teardown(state: dict, procs: tuple | list = ()) -> None:
    """Removes everything ``state`` describes; every step tolerates what is already gone."""
    for p in procs:
        with contextlib.suppress(OSError):
            p.kill()
    for ns in state["namespaces"]:
        for _ in range(50):  # kill until empty: a dying sshd may still fork a session
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.02)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
    for ns in state["namespaces"]:
        _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    for link in [*state["veths"], state["bridge"]]:
        if Path(f"/sys/class/net/{link}").exists():
            _run("ip", "link", "del", link, check=False)
    if state.get("forward_rule"):
        _run("iptables", "-D", "FORWARD", *state["forward_rule"], check=False)
    if state.get("root"):
        shutil.rmtree(state["root"], ignore_errors=True)
    (STATE_DIR / f"{state['prefix']}.json").unlink(missing_ok=True)


PYENV_LOCK_STALE_S = 10.0  # a rehash holds the lock for well under a second
PYENV_LOCK_WATCH_S = 2.0


def _release_pyenv_lock(stale_s: float = PYENV_LOCK_STALE_S) -> bool:
    """Where root's .bashrc runs `pyenv init` (these machines'), every SSH login runs pyenv's rehash, which
    holds $PYENV_ROOT/shims/.pyenv-shim while it works. A login shell killed in that moment (crash(), or a test
    run stopped with SIGKILL) leaves the lock behind, and every later login on the machine then waits
    PYENV_REHASH_TIMEOUT (60 s) for it, in this test bed and in any other. Rehashes waiting for the lock are no
    sign that it is held: only its age is. Removes a lock older than `stale_s`; True if it did."""
    lock = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "shims" / ".pyenv-shim"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > stale_s:
            lock.unlink()
            return True
    return False


class _PyenvLockWatch:
    """While a test bed lives, a lock left by a killed login is removed within PYENV_LOCK_STALE_S +
    PYENV_LOCK_WATCH_S, so logins wait seconds, not a minute each."""

    def __init__(self, every_s: float = PYENV_LOCK_WATCH_S) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="pyenv-lock-watch", daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(OSError):
                _release_pyenv_lock()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Testbed:
    """N hosts on one bridge; create with ``Testbed.create(n, root)``, remove with ``destroy()`` (or ``with``)."""

    __test__ = False  # not a pytest test class, though its name starts with "Test"

    def __init__(self, state: dict, hosts: list[Host]):
        self.state, self.hosts = state, hosts
        self.root = Path(state["root"])
        self.prefix, self.bridge = state["prefix"], state["bridge"]
        self.gateway = f"{SUBNET}.{state['k']}.1"
        self.key = self.root / "id_ed25519"
        self.authorized_keys = self.root / "authorized_keys"
        self._procs: list[subprocess.Popen] = []
        self._destroyed = False
        self._pyenv_watch: _PyenvLockWatch | None = None

    # -- creation ------------------------------------------------------------------------------------------

    @staticmethod
    def available() -> str | None:
        """None when a test bed can be created here, else the reason why not (to skip tests with)."""
        if os.geteuid() != 0:
            return "needs root to create network namespaces (CI runs as root)"
        for tool in ("ip", SSHD, "ssh", "ssh-keygen"):
            if not shutil.which(tool):
                return f"needs {tool} (scripts/setup.sh installs it: openssh-server, openssh-client, iproute2)"
        probe = f"dtprobe{os.getpid() % 100000}"
        r = _run("ip", "netns", "add", probe, check=False)
        _run("ip", "netns", "del", probe, check=False)
        return None if r.returncode == 0 else f"cannot create a network namespace: {r.stderr.strip()}"

    @classmethod
    def create(cls, n: int, root: Path, *, hostnames: bool = False, private: tuple[str, ...] = ()) -> Testbed:
        """Creates ``n`` hosts with files under ``root`` (which must not exist or be empty; destroy() deletes it).

        ``hostnames``: each host runs under its own hostname (h0, h1, ...) and resolves the others' names.
        ``private``: absolute directories each host gets its own empty copy of (see the module docstring)."""
        root = Path(root).resolve()
        if root.exists() and any(root.iterdir()):
            raise ValueError(f"test bed root {root} is not empty")
        cls.cleanup_stale()
        root.mkdir(parents=True, exist_ok=True)
        with _locked():
            prefix = next(p for p in (f"dt{secrets.token_hex(2)}" for _ in range(100)) if not cls._taken(p))
            k = cls._free_slot()
            state = {
                "prefix": prefix, "k": k, "pid": os.getpid(), "start": _start_time(os.getpid()),
                "root": str(root), "bridge": f"dtbr{prefix[2:]}", "forward_rule": None,
                "namespaces": [f"{prefix}-h{i}" for i in range(n)], "veths": [f"{prefix}v{i}" for i in range(n)],
                "hostnames": hostnames, "private": list(private),
            }  # fmt: skip
            (STATE_DIR / f"{prefix}.json").write_text(json.dumps(state))  # written before anything exists
            bed = cls(state, [])
            try:
                bed._make_network(n)
            except BaseException:
                bed.destroy()
                raise
        bed._pyenv_watch = _PyenvLockWatch()
        try:
            bed._start_hosts(n)
        except BaseException:
            bed.destroy()
            raise
        return bed

    @staticmethod
    def _taken(prefix: str) -> bool:
        return (STATE_DIR / f"{prefix}.json").exists() or Path(f"/sys/class/net/dtbr{prefix[2:]}").exists()

    @staticmethod
    def _free_slot() -> int:
        """The lowest k in 1..254 that no test bed's state file, local address or route in 10.213.k.0/24 uses."""
        used = {json.loads(f.read_text()).get("k") for f in STATE_DIR.glob("dt*.json")}
        text = _run("ip", "-4", "-o", "addr", "show").stdout + _run("ip", "-4", "route", "show", "table", "all").stdout
        used |= {int(m) for m in re.findall(rf"\b{re.escape(SUBNET)}\.(\d+)\.", text)}
        return next(k for k in range(1, 255) if k not in used)

    def _make_network(self, n: int) -> None:
        br, k = self.bridge, self.state["k"]
        _run("ip", "link", "add", "name", br, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", br)
        _run("ip", "link", "set", br, "up")
        # Docker sets the FORWARD policy to DROP, which (with br_netfilter) also drops bridged traffic.
        if shutil.which("iptables") and "-P FORWARD DROP" in _run("iptables", "-S", "FORWARD", check=False).stdout:
            self.state["forward_rule"] = ["-i", br, "-o", br, "-j", "ACCEPT"]
            (STATE_DIR / f"{self.prefix}.json").write_text(json.dumps(self.state))
            _run("iptables", "-I", "FORWARD", *self.state["forward_rule"])
        names = {f"h{i}": f"{SUBNET}.{k}.{11 + i}" for i in range(n)}
        for i, (ns, veth) in enumerate(zip(self.state["namespaces"], self.state["veths"], strict=True)):
            peer = f"{self.prefix}p{i}"
            _run("ip", "netns", "add", ns)
            if self.state.get("hostnames"):
                _debian_hosts(ns, f"h{i}", {name: a for name, a in names.items() if name != f"h{i}"})
            else:
                _debian_hosts(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", veth, "master", br, "up")
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _run("ip", "link", "set", peer, "name", "eth0", ns=ns)
            _run("ip", "addr", "add", f"{SUBNET}.{k}.{11 + i}/24", "dev", "eth0", ns=ns)
            _run("ip", "link", "set", "eth0", "up", ns=ns)

    def _start_hosts(self, n: int) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dtrain-testbed-{self.prefix}", "-f", str(self.key))
        self.authorized_keys.write_text(self.key.with_suffix(".pub").read_text())
        for i, ns in enumerate(self.state["namespaces"]):
            name, address = f"h{i}", f"{SUBNET}.{self.state['k']}.{11 + i}"
            d = self.root / name
            (d / "work").mkdir(parents=True)
            hostkey = d / "ssh_host_ed25519_key"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}-{self.prefix}", "-f", str(hostkey))
            config = {
                "ListenAddress": f"{address}:22", "HostKey": hostkey, "PidFile": d / "sshd.pid",
                "AuthorizedKeysFile": self.authorized_keys, "PermitRootLogin": "prohibit-password",
                "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "UsePAM": "no",
                "StrictModes": "no", "Subsystem": "sftp internal-sftp", "LogLevel": "VERBOSE",
                "MaxSessions": 32, "MaxStartups": 64,
            }  # fmt: skip
            # No AcceptEnv line: sshd then accepts no environment variable from clients.
            (d / "sshd_config").write_text("".join(f"{key} {value}\n" for key, value in config.items()))
            pub = hostkey.with_suffix(".pub").read_text().strip()
            self.hosts.append(Host(name, address, ns, d, d / "work", pub))
        for host in self.hosts:
            self._make_private(host)
            self._start_sshd(host)

    def _make_private(self, host: Host) -> None:
        """The host's own copy of each private directory: empty, with the real one's owner and mode."""
        for path in self.state.get("private", []):
            real, mine = Path(path), host.dir / "fs" / path.lstrip("/")
            real.mkdir(parents=True, exist_ok=True)  # a mount point (an empty directory when it was missing)
            mine.mkdir(parents=True, exist_ok=True)
            st = real.stat()
            os.chown(mine, st.st_uid, st.st_gid)
            mine.chmod(st.st_mode & 0o7777)

    def _start_sshd(self, host: Host) -> None:
        """sshd of ``host``: under its own hostname and private directories when the test bed has them."""
        argv = [SSHD, "-D", "-e", "-f", str(host.dir / "sshd_config")]
        private = self.state.get("private", [])
        if self.state.get("hostnames") or private:
            steps = [f"hostname {host.name}"] if self.state.get("hostnames") else []
            steps += [f"mount --bind {host.dir / 'fs' / p.lstrip('/')} {p}" for p in private]
            # A mount namespace of its own (propagation private: nothing reaches the machine's), inherited by
            # every SSH session and what it starts.
            argv = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                    " && ".join([*steps, 'exec "$@"']), "sh", *argv]  # fmt: skip
        log = host.dir / "sshd.log"
        proc = self._spawn(host, argv, log)
        _wait_listening(host.address, 22, proc, f"sshd of {host.name}", log)

    def crash(self, host: Host) -> None:
        """Kills every process of ``host`` at once (sshd, sessions, daemons, jobs), as a machine that dies."""
        for _ in range(50):  # until empty: a dying sshd may still fork a session
            pids = self.pids(host)
            if not pids:
                _release_pyenv_lock()
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        raise RuntimeError(f"processes of {host.name} survive SIGKILL: {self.pids(host)}")

    def revive(self, host: Host) -> None:
        """Starts ``host``'s sshd again after crash() (its private directories keep what was written there)."""
        self._start_sshd(host)

    def _spawn(self, host: Host, argv: list[str], log: Path, **kwargs) -> subprocess.Popen:
        """Starts a server in ``host`` with output to ``log``; destroy() kills it."""
        with open(log, "wb") as out:
            proc = self.popen(host, argv, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        self._procs.append(proc)
        return proc

    # -- use -----------------------------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called ``name`` (h0, h1, ...)."""
        return next(h for h in self.hosts if h.name == name)

    def known_hosts_lines(self) -> str:
        """known_hosts lines ``<addr> ssh-ed25519 AAAA...`` for every host."""
        return "".join(f"{h.address} {' '.join(h.host_key_pub.split()[:2])}\n" for h in self.hosts)

    def write_known_hosts(self, path: Path) -> Path:
        """Writes ``known_hosts_lines()`` to ``path``; returns it."""
        Path(path).write_text(self.known_hosts_lines())
        return Path(path)

    def exec(self, host: Host, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(argv)`` inside the host's namespace (network only; same filesystem and users)."""
        kwargs.setdefault("check", False)
        return subprocess.run(["ip", "netns", "exec", host.namespace, *argv], **kwargs)

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(argv)`` inside the host's namespace, in its own session; destroy() kills it."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], **kwargs)

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's namespace (sshd, its sessions, what they started)."""
        return [int(p) for p in _run("ip", "netns", "pids", host.namespace).stdout.split()]

    def block_port(self, host: Host, port: int) -> None:
        """Silently drops incoming TCP to ``port`` on ``host`` (connects time out, open connections stall)."""
        _run("iptables", "-I", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP", ns=host.namespace)

    def unblock_port(self, host: Host, port: int) -> None:
        """Undoes ``block_port``."""
        _run("iptables", "-D", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP", ns=host.namespace)

    def start_gcs_emulator(self, host: Host, port: int = 9023) -> str:
        """Starts gcp-storage-emulator (in memory) inside ``host``; returns ``http://<addr>:<port>`` once it listens."""
        d = host.dir / f"gcs-{port}"
        d.mkdir(exist_ok=True)
        # The emulator reads HOST, PORT and STORAGE_BASE itself and must not see its clients' variable.
        env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "HOST", "PORT")}
        env["STORAGE_BASE"] = str(d)
        log = d / "emulator.log"
        argv = [sys.executable, "-m", "gcp_storage_emulator", "start",
                "--host", host.address, "--port", str(port), "--in-memory", "--quiet"]  # fmt: skip
        proc = self._spawn(host, argv, log, cwd=d, env=env)
        _wait_listening(host.address, port, proc, f"gcs emulator on {host.name}", log)
        return f"http://{host.address}:{port}"

    def cluster_toml(
        self,
        name: str,
        python: str,
        env: dict[str, str] | None = None,
        known_hosts: str | None = None,
        interface: str | None = None,
    ) -> str:
        """The ``[clusters.<name>]`` table for dtrain.toml describing this test bed (backend "hosts").

        No ``interface`` by default: like Debian hosts, the namespaces share a hostname that resolves to
        loopback, and dtrain must find each node's interface itself."""
        q = json.dumps  # a JSON string is a valid TOML basic string
        bare = lambda k: k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else q(k)  # noqa: E731
        key = bare(name)
        lines = [f"[clusters.{key}]", 'backend = "hosts"', 'user = "root"', f"key = {q(str(self.key))}"]
        lines += [f"python = {q(python)}", "rdzv_port = 29400"]
        if known_hosts is not None:
            lines.append(f"known_hosts = {q(str(known_hosts))}")
        if env:
            lines += ["", f"[clusters.{key}.env]", *(f"{bare(k)} = {q(v)}" for k, v in env.items())]
        for i, h in enumerate(self.hosts):
            lines += ["", f"[[clusters.{key}.nodes]]", f"name = {q(h.name)}", f"address = {q(h.address)}"]
            lines += ["master = true"] if i == 0 else []
            lines += [f"workdir = {q(str(h.workdir))}"] + ([f"interface = {q(interface)}"] if interface else [])
        return "\n".join(lines) + "\n"

    # -- removal -------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Kills every process in the hosts, removes namespaces, links, the iptables rule and the root dir.

        Idempotent, and safe after a partial create() or a failed test.
        """
        if not self._destroyed:
            self._destroyed = True
            if self._pyenv_watch is not None:
                self._pyenv_watch.stop()
            _teardown(self.state, self._procs)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    @staticmethod
    def cleanup_stale(everything: bool = False) -> list[str]:
        """Removes test beds whose owning process is dead (all of them if ``everything``); returns their prefixes.

        Also removes dtrain namespaces and links that no state file accounts for (e.g. after /run was wiped).
        """
        with _locked():
            return Testbed._reap(everything)

    @staticmethod
    def _reap(everything: bool) -> list[str]:
        removed, known = [], set()
        for f in sorted(STATE_DIR.glob("dt*.json")):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(f.read_text())
                known.add(state["prefix"][2:])
                if everything or _start_time(state["pid"]) != state["start"]:
                    _teardown(state)
                    removed.append(state["prefix"])
        names = _run("ip", "netns", "list", check=False).stdout.split() + os.listdir("/sys/class/net")
        for hexid in sorted({m.group(1) or m.group(2) for m in map(PREFIX_RE.match, names) if m} - known):
            prefix = f"dt{hexid}"
            nss = [n for n in names if n.startswith(f"{prefix}-h")]
            veths = [n for n in names if re.fullmatch(rf"{prefix}[vp]\d+", n)]
            _teardown({"prefix": prefix, "namespaces": nss, "veths": veths, "bridge": f"dtbr{hexid}"})
            removed.append(prefix)
        return removed

    @staticmethod
    def remove_at(root: Path) -> bool:
        """Removes the test bed whose root dir is ``root``, whoever owns it; False if there is none."""
        root = Path(root).resolve()
        with _locked():
            for f in STATE_DIR.glob("dt*.json"):
                state = json.loads(f.read_text())
                if Path(state["root"]) == root:
                    _teardown(state)
                    return True
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create a test bed and keep it until Ctrl-C/SIGTERM")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--dir", type=Path, required=True, help="root dir (created; deleted at teardown)")
    up.add_argument("--python", default=sys.executable, help="interpreter with torch, for the cluster TOML")
    up.add_argument("--gcs", action="store_true", help="also run a GCS emulator on h0 and export it to the nodes")
    down = sub.add_parser("down", help="remove a test bed left behind")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--dir", type=Path, help="the test bed with this root dir")
    which.add_argument("--all", action="store_true", help="every test bed whose owner is gone")
    args = parser.parse_args(argv)

    if args.cmd == "down":
        if args.all:
            print("removed:", " ".join(Testbed.cleanup_stale()) or "nothing")
            return 0
        if Testbed.remove_at(args.dir):
            return 0
        print(f"no test bed at {args.dir}", file=sys.stderr)
        return 1

    if reason := Testbed.available():
        print(f"cannot create a test bed: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # tear down through the finally below
    with Testbed.create(args.hosts, args.dir) as tb:
        env = {"STORAGE_EMULATOR_HOST": tb.start_gcs_emulator(tb.hosts[0])} if args.gcs else None
        known = tb.write_known_hosts(tb.root / "known_hosts")
        print(tb.cluster_toml("testbed", args.python, env=env, known_hosts=str(known)))
        for h in tb.hosts:
            print(f"# ssh -i {tb.key} -o UserKnownHostsFile={known} root@{h.address}   ({h.name}, {h.namespace})")
        print("press Ctrl-C to tear down", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
