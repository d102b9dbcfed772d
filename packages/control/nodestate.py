"""A cluster's nodes as they are now: reachable or not, each GPU's utilisation, memory and temperature
(nvidia-smi, as `dtrain gpus` reads it), CPU utilisation and load, memory in use. One command per
node, all nodes at once, so a page that shows them (the dashboard's Cluster page) costs one round trip.
A node that cannot be reached is reported as such; it never hides the others."""

from __future__ import annotations

import dataclasses
import subprocess
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control import launchers
from dtrain.control.cluster import Cluster, Node
from dtrain.control.nodes import GPU_COMMAND, GpuRow, _gpu_result

HOST_MARK = "@@dtrain-host"
# /proc/stat sampled twice this far apart: CPU utilisation over the interval.
CPU_SAMPLE_S = 0.5
STATE_TIMEOUT_S = 30
HOST_COMMAND = (
    f"{GPU_COMMAND}; echo {HOST_MARK}; nproc; cat /proc/loadavg; "
    "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; "
    f"head -1 /proc/stat; sleep {CPU_SAMPLE_S}; head -1 /proc/stat"
)


@dataclasses.dataclass
class NodeState:
    name: str
    role: str  # master | worker
    address: str
    reachable: bool
    detail: str = ""  # why it is not reachable, or what went wrong reading it
    gpus: list[GpuRow] | str = ""  # a string says why there are none (a CPU-only node says so)
    cpus: int | None = None
    cpu_percent: float | None = None
    load1: float | None = None
    mem_total_mib: int | None = None
    mem_used_mib: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpus"] = self.gpus if isinstance(self.gpus, str) else [dataclasses.asdict(g) for g in self.gpus]
        d["cpu_only"] = isinstance(self.gpus, str)
        return d


def node_states(cluster: Cluster, ssh: Any = None) -> list[NodeState]:
    """Every node's state, master first. `ssh` is an open dtrain.control.ssh.SSH session to reuse
    (a service polling every few seconds keeps one); without it one is opened and closed here.
    A cluster that is this machine is read without SSH."""
    launchers.require(cluster, launchers.Feature.GPU_QUERY, "reading the nodes' states")
    if launchers.has(cluster, launchers.Feature.LOCAL):
        node = cluster.master
        p = subprocess.run(["sh", "-c", HOST_COMMAND], capture_output=True, text=True, check=False, timeout=60)
        return [parse_state(node, p.returncode, p.stdout, p.stderr)]
    if ssh is None:
        from dtrain.control.nodes import ssh_to

        with ssh_to(cluster, False) as session:
            return node_states(cluster, session)

    def one(node: Node) -> NodeState:
        try:
            p = ssh.run(node, HOST_COMMAND, timeout=STATE_TIMEOUT_S, check=False)
        except UserError as e:  # unreachable, refused host key, no answer in time
            return NodeState(node.name, _role(node), node.address, reachable=False, detail=str(e))
        return parse_state(node, p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))

    return list(ssh.each(one).values())


def _role(node: Node) -> str:
    return "master" if node.master else "worker"


def parse_state(node: Node, code: int, out: str, err: str) -> NodeState:
    """HOST_COMMAND's output: nvidia-smi's part, then the host's (nproc, loadavg, meminfo, two
    samples of /proc/stat's cpu line)."""
    gpu_part, mark, host_part = out.partition(HOST_MARK + "\n")
    state = NodeState(node.name, _role(node), node.address, reachable=True)
    if not mark:
        state.detail = ((err or out).strip().splitlines() or [f"exit {code}"])[0]
        return state
    state.gpus = _gpu_result(0, gpu_part, "")
    lines = host_part.splitlines()
    try:
        state.cpus = int(lines[0])
        state.load1 = float(lines[1].split()[0])
        mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in lines[2:4]}  # kB
        state.mem_total_mib = mem["MemTotal"] // 1024
        state.mem_used_mib = (mem["MemTotal"] - mem["MemAvailable"]) // 1024
        state.cpu_percent = _cpu_percent(lines[4], lines[5])
    except (IndexError, ValueError, KeyError):
        state.detail = f"could not read the node's CPU and memory: {host_part.strip()[:200]!r}"
    return state


def _cpu_percent(first: str, second: str) -> float | None:
    """Busy share of the time between two `cpu ...` lines of /proc/stat (idle = idle + iowait)."""
    a = [int(x) for x in first.split()[1:]]
    b = [int(x) for x in second.split()[1:]]
    total = sum(b) - sum(a)
    idle = (b[3] + b[4]) - (a[3] + a[4])
    return round(100.0 * (total - idle) / total, 1) if total > 0 else None
