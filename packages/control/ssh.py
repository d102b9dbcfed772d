"""SSH to the nodes with the system OpenSSH client (docs/decisions.md says why), one multiplexed
connection per node (ControlMaster), commands to all nodes in parallel.

Host keys are checked against dtrain's own known_hosts file (the cluster's `known_hosts`, default
~/.config/dtrain/known_hosts) with StrictHostKeyChecking=yes: a node whose key is not there is
refused with an explanation. `--accept-new-host-keys` trusts keys on first contact
(StrictHostKeyChecking=accept-new), which still refuses a key that changed. Checking is never
turned off. BatchMode: ssh never prompts; a refused key or an unreachable node is an error naming
the node.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from dtrain.common.errors import UserError
from dtrain.control.cluster import Cluster, Node

T = TypeVar("T")
SSH_FAILED = 255  # ssh's own exit status for its failures (not the remote command's)
CONNECT_TIMEOUT_S = 10
# A node that stops answering is noticed within ServerAliveInterval x ServerAliveCountMax.
ALIVE_INTERVAL_S = 5
ALIVE_COUNT = 3


class NodeError(UserError):
    """A failure reaching or running something on one node; the message names the node."""

    def __init__(self, node: Node, message: str) -> None:
        super().__init__(f"node {node.describe()}: {message}")
        self.node = node


class SSH:
    def __init__(self, cluster: Cluster, *, accept_new_host_keys: bool = False) -> None:
        self.cluster = cluster
        self.accept_new = accept_new_host_keys
        self.known_hosts = cluster.known_hosts
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        if not self.known_hosts.exists():
            self.known_hosts.touch(mode=0o600)
        # ControlPath must fit a unix socket name (~104 bytes): a short private directory and %C.
        # One directory per trust setting, so that a connection opened under one known_hosts file or
        # acceptance policy is never reused under another.
        trust = hashlib.sha256(f"{self.known_hosts.resolve()}|{self.accept_new}".encode()).hexdigest()[:8]
        base = Path(tempfile.gettempdir()) / f"dtrain-ssh-{os.getuid()}"
        base.mkdir(mode=0o700, exist_ok=True)
        self.control_dir = base / trust
        self.control_dir.mkdir(mode=0o700, exist_ok=True)

    def argv(self, node: Node, *, tty: bool = False, master: bool = True) -> list[str]:
        """ssh's argv up to and including the destination and `--`."""
        argv = [
            "ssh",
            "-p",
            str(node.port),
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}",
            "-o", f"ServerAliveCountMax={ALIVE_COUNT}",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"StrictHostKeyChecking={'accept-new' if self.accept_new else 'yes'}",
            "-o", "HashKnownHosts=no",  # dtrain's known_hosts stays readable: which nodes are trusted
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if master:
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_dir}/%C", "-o", "ControlPersist=60"]
        if node.key:
            argv += ["-i", node.key, "-o", "IdentitiesOnly=yes"]
        if node.proxy_command:
            argv += ["-o", f"ProxyCommand={node.proxy_command}"]
        return [*argv, "-tt" if tty else "-T", node.destination, "--"]

    def run(
        self,
        node: Node,
        command: str,
        *,
        input: bytes | None = None,  # noqa: A002 - subprocess's name
        timeout: float = 120,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run a shell command line on `node`; ssh failures (exit 255) raise NodeError, as does a
        non-zero exit with check=True."""
        try:
            p = subprocess.run(
                [*self.argv(node), command],
                input=input,
                capture_output=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL if input is None else None,
                start_new_session=True,  # a terminal's Ctrl-C is for dtrain to handle, not for a short command
            )
        except subprocess.TimeoutExpired:
            raise NodeError(node, f"no answer within {timeout:.0f} s running {_short(command)}") from None
        if p.returncode == SSH_FAILED:
            raise NodeError(node, explain(p.stderr.decode(errors="replace"), node, self.known_hosts, p.returncode))
        if check and p.returncode != 0:
            tail = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise NodeError(node, f"{_short(command)} exited {p.returncode}: {tail[0]}")
        return p

    def popen(self, node: Node, command: str, **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen([*self.argv(node), command], **kwargs)

    def each(self, fn: Callable[[Node], T], nodes: Iterable[Node] | None = None) -> dict[str, T]:
        """fn(node) on every node at once; raises the first node's error (in inventory order)
        after all have finished, naming the others that failed too."""
        nodes = list(self.cluster.nodes if nodes is None else nodes)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
            futures = {n.name: pool.submit(fn, n) for n in nodes}
        errors = [(name, f.exception()) for name, f in futures.items() if f.exception() is not None]
        if errors:
            first = errors[0][1]
            if len(errors) > 1 and isinstance(first, UserError):
                others = ", ".join(name for name, _ in errors[1:])
                raise UserError(f"{first} (also failed: {others})") from first
            raise first  # type: ignore[misc]
        return {name: f.result() for name, f in futures.items()}

    def connect_all(self) -> None:
        """Open (or reuse) the connection to every node; fails naming the node that cannot be reached."""
        self.each(lambda n: self.run(n, "true", timeout=CONNECT_TIMEOUT_S + 20))

    def close(self) -> None:
        """Close the shared connections (ssh -O exit); best effort."""
        for n in self.cluster.nodes:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [*self.argv(n)[:-2], "-O", "exit", n.destination],
                    capture_output=True,
                    timeout=10,
                    stdin=subprocess.DEVNULL,
                )

    def __enter__(self) -> SSH:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def explain(stderr: str, node: Node, known_hosts: Path, code: int = SSH_FAILED) -> str:
    """ssh's complaint (it exited `code`, 255: its own failure) as one line that says what to do."""
    text = " ".join(stderr.split())
    low = text.lower()
    if "remote host identification has changed" in low or "host key for" in low and "has changed" in low:
        return (
            f"its host key CHANGED since it was trusted (a rebuilt machine, or someone in the middle); "
            f"refusing. If the machine was rebuilt, remove its line from {known_hosts} and connect again"
        )
    if "host key verification failed" in low or "no matching host key" in low:
        return (
            f"its host key is not in dtrain's known_hosts ({known_hosts}); check the machine is the one you "
            "mean, then run again with --accept-new-host-keys to trust it on first contact"
        )
    if "permission denied" in low:
        key = node.key or "ssh's default keys"
        user = node.user or "your user name"
        return f"the SSH login was refused (wrong key or user): key {key}, user {user}"
    if "connection refused" in low:
        return f"nothing accepts SSH connections on port {node.port} (is sshd running?)"
    if "could not resolve hostname" in low or "name or service not known" in low:
        return f"cannot resolve the host name {node.ssh_host or node.address}"
    if any(s in low for s in ("timed out", "no route to host", "network is unreachable", "host is down")):
        return f"unreachable: no answer on {node.ssh_host or node.address}:{node.port} ({_last(text)})"
    if "identity file" in low and "not accessible" in low:
        return f"the SSH key {node.key} cannot be read"
    if "broken pipe" in low or "connection reset" in low or "closed by remote host" in low:
        return f"the SSH connection dropped ({_last(text)})"
    if text:
        return f"ssh failed (exit {code}): {_last(text)}"
    # ssh said nothing (its stderr lost, or LogLevel=QUIET): the exit code is all there is
    return (
        f"ssh exited {code} without a message: 255 is ssh's own failure (the connection, the login or the host "
        f"key), not the remote command's; `ssh -v -p {node.port} {node.destination}` shows which"
    )


def _last(text: str) -> str:
    return text.strip().rstrip(".")[-200:]


def _short(command: str) -> str:
    return command if len(command) < 60 else command[:57] + "..."
