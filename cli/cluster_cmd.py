"""Commands on a cluster's nodes: `dtrain doctor`, `dtrain gpus`, `dtrain exec`, `dtrain ssh`, and
`dtrain logs` (a run's per-node logs, replayed)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import ExitCode, UserError

GPU_QUERY = "index,name,memory.used,memory.total,utilization.gpu,temperature.gpu,driver_version"
LOW_DISK_BYTES = 10 * 2**30  # checkpoints and a model's weights need room
LOW_GPU_FREE_FRACTION = 0.9  # a GPU with less than 90% of its memory free is already in use


def load_cluster(name: str | None) -> Any:
    """The cluster `name` (default: run.cluster from the settings) as a cli.cluster.Cluster."""
    from dtrain.cli.cluster import resolve
    from dtrain.cli.settings import get_cluster, load_settings

    settings = load_settings(console.state.config_path, {"run.cluster": name})
    return resolve(get_cluster(settings))


def _ssh(cluster: Any, accept_new: bool) -> Any:
    from dtrain.cli.ssh import SSH

    if cluster.backend == "local":
        raise UserError(
            "this command runs on a cluster's nodes: pass --cluster NAME (a [clusters.NAME] in dtrain.toml)"
        )
    return SSH(cluster, accept_new_host_keys=accept_new)


# ---------------------------------------------------------------------------------------------
# dtrain gpus


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


def gpus(
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Query every node's GPUs with nvidia-smi: model, memory, utilisation, temperature, driver."""
    c = load_cluster(cluster)
    results: dict[str, list[GpuRow] | str] = {}
    if c.backend == "local":
        p = subprocess.run(["sh", "-c", GPU_COMMAND], capture_output=True, text=True, check=False)
        results["local"] = _gpu_result(p.returncode, p.stdout, p.stderr)
    else:
        with _ssh(c, accept_new_host_keys) as ssh:
            ssh.connect_all()

            def one(node: Any) -> list[GpuRow] | str:
                p = ssh.run(node, GPU_COMMAND, timeout=60, check=False)
                return _gpu_result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))

            results = ssh.each(one)
    if as_json:
        out = {n: r if isinstance(r, str) else [dataclasses.asdict(g) for g in r] for n, r in results.items()}
        console.out.print_json(json.dumps(out))
        return
    from rich.table import Table

    t = Table("node", "gpu", "model", "memory used / total", "util", "temp", "driver")
    for node, r in results.items():
        if isinstance(r, str):
            t.add_row(node, "-", r, "", "", "", "")
            continue
        for g in r:
            t.add_row(node, g.index, g.name, f"{g.used_mib} / {g.total_mib} MiB", f"{g.util}%", f"{g.temp} C", g.driver)
    console.out.print(t)


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
# dtrain exec / ssh


def exec_(
    node: Annotated[str, typer.Argument(help="node name, or 'all' for every node")],
    command: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
) -> None:
    """Run one command on a node (or on every node, output prefixed), e.g. `dtrain exec n1 -- nvidia-smi`."""
    c = load_cluster(cluster)
    line = shlex.join(command)
    with _ssh(c, accept_new_host_keys) as ssh:
        if node != "all":
            target = c.node(node)
            ssh.run(target, "true", timeout=60)  # reach it first, so a failure is explained in one line
            p = subprocess.run([*ssh.argv(target), line], check=False)
            console.state.exit_code = p.returncode
            return
        ssh.connect_all()

        def one(n: Any) -> subprocess.CompletedProcess:
            return ssh.run(n, line, timeout=3600, check=False)

        codes = 0
        for name, p in ssh.each(one).items():
            for text in (p.stdout + p.stderr).decode(errors="replace").splitlines():
                console.out.print(f"[{name}] {text}", markup=False, highlight=False, soft_wrap=True)
            codes = codes or p.returncode
        console.state.exit_code = codes


def ssh_(
    node: Annotated[str, typer.Argument(help="node name (default: the master)")] = "",
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
) -> None:
    """Open a shell on a node, with the cluster's user, key and host-key checking."""
    c = load_cluster(cluster)
    ssh = _ssh(c, accept_new_host_keys)
    target = c.node(node) if node else c.master
    argv = ssh.argv(target, tty=True, master=False)[:-1]  # no `--`: an interactive login shell
    sys.stdout.flush()
    os.execvp(argv[0], argv)


# ---------------------------------------------------------------------------------------------
# dtrain logs


def logs(
    run: Annotated[str, typer.Argument(help="run id under --output, or the run's directory / gs:// URL")],
    output: o.Output = None,
    node: Annotated[str | None, typer.Option("--node", help="only this node's lines", show_default=False)] = None,
) -> None:
    """Replay a cluster run's logs: every node's lines in time order, prefixed with the node's name."""
    from dtrain.cli.remote import logs_cache_dir
    from dtrain.cli.settings import load_settings
    from dtrain.common.rundir import locate

    settings = load_settings(console.state.config_path, {"run.output": output})
    store = locate(settings.run.output, run)
    run_id = store.url.rstrip("/").rsplit("/", 1)[-1]
    names = [f for f in store.list("logs") if f.endswith(".log")]
    files = {Path(f).stem: store.read_bytes(f).decode(errors="replace") for f in names}
    if not files:
        cache = logs_cache_dir(run_id)
        files = {p.stem: p.read_text(errors="replace") for p in sorted(cache.glob("*.log"))}
    if not files:
        raise UserError(f"run {store.url} has no node logs (only runs launched on a cluster keep them, under logs/)")
    if node is not None and node not in files:
        raise UserError(f"run {run_id} has no log for node {node!r} (nodes: {', '.join(sorted(files))})")
    entries = []
    for name, text in files.items():
        if node is not None and name != node:
            continue
        for i, line in enumerate(text.splitlines()):
            stamp, _, rest = line.partition(" ")
            entries.append((stamp, name, i, rest))
    for _stamp, name, _i, rest in sorted(entries):
        console.out.print(f"[{name}] {rest}", markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# dtrain doctor


@dataclasses.dataclass
class Check:
    node: str
    check: str
    ok: bool
    detail: str
    fix: str = ""


def doctor(
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    mib: Annotated[float, typer.Option("--mib", help="all-reduce size in MiB")] = 64.0,
) -> None:
    """Check a cluster before spending money: SSH, versions, ports between every pair of nodes,
    a short all-reduce (nccl on GPU, gloo on CPU) with its bandwidth, disk and GPU memory free."""
    from dtrain.cli import remote

    c = load_cluster(cluster)
    ssh = _ssh(c, accept_new_host_keys)
    checks: list[Check] = []
    run_id = f"doctor-{os.getpid()}"
    with ssh:
        reachable = []
        for n in c.nodes:
            try:
                ssh.run(n, "true", timeout=40)
                checks.append(Check(n.name, "ssh", True, f"{n.destination}:{n.port}"))
                reachable.append(n)
            except UserError as e:
                checks.append(Check(n.name, "ssh", False, str(e).split(": ", 1)[-1], "fix the inventory or the node"))
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
        ports_ok = len(reachable) == len(c.nodes)
        if len(reachable) > 1:
            port_checks = _port_checks(ssh, c, run_id, reachable)
            checks += port_checks
            ports_ok = ports_ok and all(pc.ok for pc in port_checks)
        if ports_ok and len(infos) == len(c.nodes) and all(i.torch for i in infos.values()):
            checks.append(_allreduce(ssh, c, run_id, infos, mib))
        else:
            checks.append(Check("all", "all-reduce", False, "skipped: fix the checks above first"))
        with contextlib.suppress(Exception):
            ssh.each(lambda n: ssh.run(n, f"rm -rf {shlex.quote(remote.run_dir(n, run_id))}", check=False), reachable)
    _print_checks(checks)
    if not all(ch.ok for ch in checks):
        failed = [ch for ch in checks if not ch.ok]
        console.error(
            f"{len(failed)} check(s) failed: first: node {failed[0].node}, {failed[0].check}: {failed[0].detail}"
        )
        console.state.exit_code = int(ExitCode.FAILURE)


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
    from dtrain.cli import remote

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


def _allreduce(ssh: Any, c: Any, run_id: str, infos: dict[str, Any], mib: float) -> Check:
    from dtrain.cli import remote
    from dtrain.common.allreduce_check import RESULT_PREFIX

    gpus = infos[c.master.name].gpus
    nproc = gpus or 1
    specs = {
        n.name: remote.job_spec(
            c,
            n,
            module="dtrain.common.allreduce_check",
            run_id=run_id,
            nproc=nproc,
            threads=max(1, infos[n.name].cpus // nproc),
            max_restarts=0,
            argv=["--mib", str(mib)],
        )
        for n in c.nodes
    }
    job = remote.Job(ssh, c, run_id, specs, None, echo=False)
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
    return Check(
        "all", "all-reduce", False, f"failed (exit {code}): {tail[-300:]}", "run with --debug for torch's logs"
    )


def _print_checks(checks: list[Check]) -> None:
    from rich.table import Table

    t = Table("node", "check", "", "detail", "what to do")
    for ch in checks:
        t.add_row(ch.node, ch.check, "[green]ok[/]" if ch.ok else "[red]FAIL[/]", ch.detail, ch.fix)
    console.out.print(t)
