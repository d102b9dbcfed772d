"""Work on a cluster's nodes: their GPUs (nvidia-smi), a command on every node, and `doctor`'s checks
(SSH, versions, ports between every pair of nodes, an all-reduce, disk, GPU memory)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control import launchers
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Events, Handle

GPU_QUERY = "index,name,memory.used,memory.total,utilization.gpu,temperature.gpu,driver_version"
LOW_DISK_BYTES = 10 * 2**30  # checkpoints and a model's weights need room
LOW_GPU_FREE_FRACTION = 0.9  # a GPU with less than 90% of its memory free is already in use


def ssh_to(cluster: Cluster, accept_new: bool, what: str = "") -> Any:
    """An SSH session to the cluster's nodes; refused for a cluster whose nodes are not reached over SSH."""
    from dtrain.control.ssh import SSH

    launchers.require(cluster, launchers.Feature.SSH, what)
    return SSH(cluster, accept_new_host_keys=accept_new)


# ---------------------------------------------------------------------------------------------
# GPUs


@dataclasses.dataclass(frozen=True)
class GpuRow:
    index: str
    name: str
    used_mib: str
    total_mib: str
    util: str
    temp: str
    driver: str


def parse_gpus(csv_text: str) -> list[GpuRow]:
    """nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits, one GPU per line."""
    rows = []
    for line in csv_text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        rows.append(GpuRow(*parts))
    return rows


GPU_COMMAND = (
    f"if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu={GPU_QUERY} "
    "--format=csv,noheader,nounits; else echo 'dtrain: no nvidia-smi'; fi"
)


def gpus(cluster: Cluster, *, accept_new_host_keys: bool = False) -> dict[str, list[GpuRow] | str]:
    """Every node's GPUs as nvidia-smi reports them; a string says why a node has none to show."""
    launchers.require(cluster, launchers.Feature.GPU_QUERY, "dtrain gpus")
    if launchers.has(cluster, launchers.Feature.LOCAL):
        p = subprocess.run(["sh", "-c", GPU_COMMAND], capture_output=True, text=True, check=False)
        return {cluster.master.name: _gpu_result(p.returncode, p.stdout, p.stderr)}
    with ssh_to(cluster, accept_new_host_keys, "dtrain gpus") as ssh:
        ssh.connect_all()

        def one(node: Node) -> list[GpuRow] | str:
            p = ssh.run(node, GPU_COMMAND, timeout=60, check=False)
            return _gpu_result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))

        return ssh.each(one)


def _gpu_result(code: int, out: str, err: str) -> list[GpuRow] | str:
    if "dtrain: no nvidia-smi" in out:
        return "no GPU (CPU only: nvidia-smi not found)"
    if code != 0:
        msg = (err or out).strip().splitlines()[:1] or [f"exit {code}"]
        return f"nvidia-smi failed: {msg[0]}"
    try:
        return parse_gpus(out) or "no GPU (nvidia-smi lists none)"
    except ValueError as e:
        return str(e)


# ---------------------------------------------------------------------------------------------
# exec


def exec_all(cluster: Cluster, command: list[str], *, accept_new_host_keys: bool = False) -> dict[str, Any]:
    """Run `command` on every node at once; node name -> CompletedProcess (bytes output)."""
    line = shlex.join(command)
    with ssh_to(cluster, accept_new_host_keys, "dtrain exec") as ssh:
        ssh.connect_all()
        return ssh.each(lambda n: ssh.run(n, line, timeout=3600, check=False))


@contextlib.contextmanager
def terminal_argv(
    cluster: Cluster, node: str, command: list[str] | None, *, accept_new_host_keys: bool = False
) -> Iterator[list[str]]:
    """The ssh command line for the caller to run on its own terminal: `command` on `node` (checked to
    answer first, so a failure is one line), or None: an interactive login shell (default node: the
    master). The shared connection closes when the block ends."""
    with ssh_to(cluster, accept_new_host_keys, "dtrain ssh" if command is None else "dtrain exec") as ssh:
        target = cluster.node(node) if node else cluster.master
        if command is None:
            yield ssh.argv(target, tty=True, master=False)[:-1]  # no `--`: a login shell
            return
        ssh.run(target, "true", timeout=60)
        yield [*ssh.argv(target), shlex.join(command)]


# ---------------------------------------------------------------------------------------------
# doctor


@dataclasses.dataclass
class Check:
    node: str
    check: str
    ok: bool
    detail: str
    fix: str = ""


def doctor(
    cluster: Cluster, *, mib: float, events: Events, handle: Handle, accept_new_host_keys: bool = False
) -> list[Check]:
    """Check a cluster before spending money: SSH, versions, ports between every pair of nodes, a
    short all-reduce (nccl on GPU, gloo on CPU) with its bandwidth, disk and GPU memory free."""
    from dtrain.control import remote

    ssh = ssh_to(cluster, accept_new_host_keys, "dtrain doctor")
    checks: list[Check] = []
    run_id = f"doctor-{os.getpid()}"
    c = cluster
    if not launchers.has(c, launchers.Feature.NODE_CHECKS):  # a user's Slurm: its login node, and Slurm from it
        from dtrain.control.slurm.setup import doctor_checks

        with ssh:
            reachable = [n for n in c.nodes if _answers(ssh, n, checks)]
            return checks + doctor_checks(ssh, c, reachable)
    with ssh:
        reachable = [n for n in c.nodes if _answers(ssh, n, checks)]
        infos: dict[str, Any] = {}
        if reachable:
            archive, _ = remote.code_archive()
            for n in reachable:
                try:
                    remote.sync_node(ssh, n, run_id, archive)
                    infos[n.name] = remote.node_info(ssh, n, run_id)
                except UserError as e:
                    checks.append(Check(n.name, "python", False, str(e), f"set python = ... for node {n.name}"))
        checks += _version_checks(c, infos)
        checks += _resource_checks(c, infos)
        checks += _interface_checks(c, infos)
        ports_ok = len(reachable) == len(c.nodes)
        if len(reachable) > 1:
            port_checks = _port_checks(ssh, c, run_id, reachable)
            checks += port_checks
            ports_ok = ports_ok and all(pc.ok for pc in port_checks)
        if ports_ok and len(infos) == len(c.nodes) and all(i.torch for i in infos.values()):
            checks.append(_allreduce(ssh, c, run_id, infos, mib, events, handle))
        else:
            checks.append(Check("all", "all-reduce", False, "skipped: fix the checks above first"))
        with contextlib.suppress(Exception):
            ssh.each(lambda n: ssh.run(n, f"rm -rf {shlex.quote(remote.run_dir(n, run_id))}", check=False), reachable)
        if launchers.has(c, launchers.Feature.QUEUE):  # munge and Slurm on every node
            from dtrain.control.slurm.setup import doctor_checks

            checks += doctor_checks(ssh, c, reachable)
    return checks


def _answers(ssh: Any, n: Node, checks: list[Check]) -> bool:
    """Whether `n` answers SSH; the result goes into `checks`."""
    try:
        ssh.run(n, "true", timeout=40)
        checks.append(Check(n.name, "ssh", True, f"{n.destination}:{n.port}"))
        return True
    except UserError as e:
        checks.append(Check(n.name, "ssh", False, str(e).split(": ", 1)[-1], "fix the inventory or the node"))
        return False


def _version_checks(c: Any, infos: dict[str, Any]) -> list[Check]:
    out = []
    m = infos.get(c.master.name)
    for n in c.nodes:
        i = infos.get(n.name)
        if i is None:
            continue
        if i.torch is None:
            out.append(
                Check(n.name, "torch", False, f"no torch in {n.python}", "install dtrain's training extras there")
            )
            continue
        same = m is None or (i.python == m.python and i.torch == m.torch)
        detail = f"python {i.python}, torch {i.torch}"
        fix = "" if same else f"install python {m.python} and torch {m.torch} like the master {c.master.name}"
        out.append(Check(n.name, "versions", same, detail + ("" if same else f" (master: {m.python}, {m.torch})"), fix))
    return out


def _resource_checks(c: Any, infos: dict[str, Any]) -> list[Check]:
    out = []
    for n in c.nodes:
        i = infos.get(n.name)
        if i is None:
            continue
        free = i.disk_free_bytes
        out.append(
            Check(
                n.name,
                "disk",
                free >= LOW_DISK_BYTES,
                f"{free / 2**30:.1f} GiB free in {i.raw.get('workdir')}",
                "" if free >= LOW_DISK_BYTES else "free some space or point workdir at a bigger disk",
            )
        )
        gpus = i.raw.get("gpus") or []
        if not gpus:
            out.append(Check(n.name, "gpu memory", True, f"no GPU (CPU only, {i.cpus} CPUs)"))
        for k, g in enumerate(gpus):
            ok = g["free_bytes"] >= LOW_GPU_FREE_FRACTION * g["total_bytes"]
            detail = f"GPU {k} {g['name']}: {g['free_bytes'] / 2**30:.1f} of {g['total_bytes'] / 2**30:.1f} GiB free"
            out.append(Check(n.name, "gpu memory", ok, detail, "" if ok else "another process holds it: `dtrain gpus`"))
    return out


def _port_checks(ssh: Any, c: Any, run_id: str, nodes: list[Any]) -> list[Check]:
    """Every node listens on the ports it needs (the master: the rendezvous port; all: one
    arbitrary port, as NCCL and gloo pick random ones); every other node connects to each."""
    from dtrain.control import remote

    out = []
    for server in nodes:
        clients = [n for n in nodes if n is not server]
        ports = [c.rdzv_port] if server.name == c.master.name else []
        ports.append(0)
        for port in ports:
            what = "rendezvous" if port == c.rdzv_port and server.name == c.master.name else "arbitrary"
            try:
                remote.check_port(ssh, run_id, server, port, clients, what)
                shown = port or "an arbitrary port"
                out.append(
                    Check(
                        server.name,
                        f"{what} port",
                        True,
                        f"{shown} reachable from {', '.join(n.name for n in clients)}",
                    )
                )
            except UserError as e:
                out.append(
                    Check(
                        server.name, f"{what} port", False, str(e).removeprefix("error: "), "open it between the nodes"
                    )
                )
    return out


def _allreduce(
    ssh: Any, c: Any, run_id: str, infos: dict[str, Any], mib: float, events: Events, handle: Handle
) -> Check:
    from dtrain.common.allreduce_check import RESULT_PREFIX
    from dtrain.control import remote

    gpus = infos[c.master.name].gpus
    nproc = gpus or 1
    work = remote.NodeWork(tail=["-m", "dtrain.common.allreduce_check", "--mib", str(mib)])
    if c.image:  # container mode: torchrun on the image's Python, as a built-in's job runs there
        c = dataclasses.replace(c, nodes=tuple(dataclasses.replace(n, python="python3") for n in c.nodes))
    specs = {
        n.name: remote.node_spec(
            c, n, work, run_id=run_id, nproc=nproc, threads=max(1, infos[n.name].cpus // nproc), gpus=infos[n.name].gpus
        )
        for n in c.nodes
    }
    job = remote.NodeAgents(ssh, c, run_id, specs, None, events=events, handle=handle, echo=False)
    code = job.run()
    for _node, line in job.output:
        if line.startswith(RESULT_PREFIX):
            r = json.loads(line[len(RESULT_PREFIX) :])
            detail = (
                f"{r['backend']}, {r['world_size']} ranks, {r['mib']:.0f} MiB: {r['ms']} ms, "
                f"algbw {r['algbw_gbps']} GB/s, busbw {r['busbw_gbps']} GB/s"
            )
            return Check("all", "all-reduce", bool(r["correct"]) and code == 0, detail)
    tail = "; ".join(line for _n, line in job.output[-3:])
    looped = [n.name for n in c.nodes if _loopback_only(n, infos[n.name])]
    if looped:
        return Check(
            "all",
            "all-reduce",
            False,
            f"failed (exit {code}): node(s) {', '.join(looped)} resolve their own hostname to a loopback address "
            "and no interface holds their cluster address, so peers are told to connect to 127.x",
            "set interface = NAME (the NIC of the cluster network) for those nodes, or fix their /etc/hosts",
        )
    return Check(
        "all", "all-reduce", False, f"failed (exit {code}): {tail[-300:]}", "run with --debug for torch's logs"
    )


def _loopback_only(node: Node, info: Any) -> bool:
    resolved = info.raw.get("hostname_resolves_to") or []
    loopback = bool(resolved) and all(a.startswith("127.") or a == "::1" for a in resolved)
    return loopback and not (node.interface or info.raw.get("ifname"))


def _interface_checks(c: Cluster, infos: dict[str, Any]) -> list[Check]:
    """Which interface each node's collectives will use: the inventory's `interface`, else the one
    that holds its cluster address (what the launcher sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to)."""
    out = []
    for n in c.nodes:
        i = infos.get(n.name)
        if i is None:
            continue
        if n.interface:
            out.append(Check(n.name, "interface", True, f"{n.interface} (set in the inventory)"))
        elif i.raw.get("ifname"):
            out.append(Check(n.name, "interface", True, f"{n.address} is on {i.raw['ifname']}: gloo/NCCL use it"))
        else:
            resolved = ", ".join(i.raw.get("hostname_resolves_to") or []) or "nothing"
            out.append(
                Check(
                    n.name,
                    "interface",
                    False,
                    f"no interface holds its address {n.address}; its hostname {i.raw.get('hostname')} resolves to "
                    f"{resolved}",
                    "set address = the node's own IP on the cluster network, or interface = NAME",
                )
            )
    return out
