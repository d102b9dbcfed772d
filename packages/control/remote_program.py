"""A user's program on a cluster's nodes over SSH: the same steps as a built-in's (remote.py), plus the
user's code and requirements.

1. connect to every node; send dtrain's node-side code (the agent, the SDK, the mirror) to the run;
2. sync the working directory to `<workdir>/code/<project>` on every node (dtrain.common.codesync: only
   what changed travels) and hard-link a snapshot of it for this run (`<workdir>/runs/<run>/work`), so a
   later sync never changes the code of a job that is running;
3. install requirements.txt / pyproject.toml and the setup commands once per node per content hash
   (dtrain.common.deps), into a virtualenv that sees the node's own torch. Steps 2 and 3, and the node's
   Python/torch/CPU/GPU report when the job runs on the node's own Python, are one process per node in one
   SSH session (deps_command: docs/decisions.md, "Start overhead"); the rendezvous port is checked meanwhile;
4. start the program on every node through the node agent: a script
   or module under torchrun (c10d on the master, as for a built-in), a command once per node with
   NODE_RANK, NNODES, MASTER_ADDR and MASTER_PORT (the checked rendezvous port, free for its own use);
5. on every node the agent puts the run's newest complete checkpoint copy back before a relaunch or a
   --resume, copies the checkpoint directory to the run's store while the program runs and once more at
   its end, and forwards the SDK's metrics (dtrain.common.nodeagent.JobFiles).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.resources import SAMPLE_EVERY_S, Recorder
from dtrain.common.rundir import CKPT_PREFIX
from dtrain.common.runrecord import job_outcome, update_status
from dtrain.common.storage import is_remote
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Events, Handle
from dtrain.control.local import processes
from dtrain.control.remote import (
    JOB_ENDED,
    LogFiles,
    NodeError,
    NodeInfo,
    NodeWork,
    check_docker,
    check_port,
    checked_infos,
    code_archive,
    hang_spec,
    node_infos,
    node_spec,
    pull_image,
    run_dir,
    sync_code,
)
from dtrain.control.remote import (
    NodeAgents as Job,  # the agents of one job over SSH (Job is program.Job's name elsewhere)
)
from dtrain.control.ssh import SSH
from dtrain.control.userjob import (
    MIRROR_INTERVAL_S,
    Target,
    contract_env,
    record_end,
    record_start,
)

CODE_SYNC_TIMEOUT_S = 600
DEPS_TIMEOUT_S = 3600  # a first install of large wheels over a slow link


def project_key(workdir: Path) -> str:
    """The folder a project's code keeps on every node: its name and a digest of where it lives here."""
    where = f"{socket.gethostname()}:{workdir.resolve()}"
    return f"{workdir.name or 'root'}-{hashlib.sha256(where.encode()).hexdigest()[:10]}"


def sync_excludes(job: Any, run_url: str) -> list[str]:
    """What of the working directory is not code: the nodes' own checkpoint directory, and a run's output
    that lives inside it (gitignore patterns, relative to the working directory)."""
    exclude = [f"/{job.checkpoint_dir.strip('/')}/"] if job.checkpoint_dir else []
    out = Path(run_url).resolve() if not is_remote(run_url) else None
    if out is not None and job.workdir in out.parents:
        exclude.append("/" + out.parent.relative_to(job.workdir).as_posix() + "/")
    return exclude


def sync_workdir(
    ssh: SSH,
    t: Target,
    workdir: Path,
    exclude: list[str],
    events: Events,
    *,
    nodes: Any = None,
    limit_mb: int = 0,
    receiver: Any = None,
) -> dict[str, str]:
    """The working directory to every node at once (only what changed), and this run's snapshot of it;
    `nodes`: the hosts that hold the run's files, when not every node of ssh's cluster (a Slurm login node).
    `receiver(node, dest, snapshot)`: the node's command line (run in its run directory) instead of codesync's
    `receive`; it speaks the sync's protocol first, then may print more, which is returned, per node (a launch's
    environment check and node info: deps_command). Its failure after the sync is its stderr's last line."""
    from dtrain.common.codesync import scan, send

    t0 = time.monotonic()
    manifest = scan(workdir, exclude=exclude, **({"limit_bytes": limit_mb << 20} if limit_mb else {}))
    key = project_key(workdir)
    after: dict[str, str] = {}

    def one(node: Node) -> Any:
        rd, dest = run_dir(node, t.run_id), f"../../code/{key}"
        line = (
            receiver(node, dest, "work")
            if receiver
            else f"{shlex.quote(node.python)} -m dtrain.common.codesync receive --dest {shlex.quote(dest)} "
            "--snapshot work"
        )
        line = f'cd {shlex.quote(rd)} && PYTHONPATH="$PWD/code" exec {line}'
        p = ssh.popen(node, line, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        errs: list[bytes] = []  # its stderr, read alongside so that a chatty step (pip) cannot stall on it
        reader = threading.Thread(target=lambda: errs.append(p.stderr.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        # The whole exchange is bounded: the sync's timeout, and with a receiver an install's as well.
        timer = threading.Timer(CODE_SYNC_TIMEOUT_S + (DEPS_TIMEOUT_S if receiver else 0), p.kill)
        timer.start()

        def last_error() -> str:
            reader.join(timeout=10)
            lines = b"".join(errs).decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else ""

        try:
            try:
                stats = send(manifest, p.stdout, p.stdin)
            except UserError as e:
                p.kill()
                raise NodeError(node, f"code sync failed: {e}") from None
            except (OSError, ValueError):
                p.kill()
                p.wait()
                raise NodeError(node, f"code sync failed: {last_error() or 'the connection closed'}") from None
            with contextlib.suppress(OSError):
                p.stdin.close()  # type: ignore[union-attr]
            out = p.stdout.read()  # type: ignore[union-attr]  # what follows the sync (buffered lines included)
            p.wait()
        finally:
            timer.cancel()
            for f in (p.stdin, p.stdout):
                with contextlib.suppress(OSError):
                    f.close()  # type: ignore[union-attr]
            if p.poll() is None:
                p.kill()
            p.wait()
        if receiver and p.returncode != 0:
            raise UserError(last_error() or f"node {node.name}: installing requirements failed (exit {p.returncode})")
        after[node.name] = out.decode(errors="replace")
        return stats

    stats = ssh.each(one, nodes)
    files = sum(s.files_sent for s in stats.values())
    sent = sum(s.bytes_sent for s in stats.values())
    what = "unchanged" if files == 0 else f"{files} file(s), {sent:,} bytes sent"
    events.emit(
        "code",
        f"code {manifest.digest[:12]} ({len(manifest.files)} files, {manifest.total_bytes:,} bytes) on "
        f"{len(stats)} node(s): {what} in {time.monotonic() - t0:.2f} s",
        digest=manifest.digest,
        files_sent=files,
        bytes_sent=sent,
        per_node={n: {"files": s.files_sent, "bytes": s.bytes_sent} for n, s in stats.items()},
    )
    return {name: after[name] for name in stats}  # in inventory order, as ssh.each gives them


def deps_args(node: Node, setup: tuple[str, ...], image: str = "") -> str:
    """`python -m dtrain.common.deps ensure`'s line on `node` (from its run directory, the code synced): make or
    reuse the job's environment there; it prints the result as a JSON line."""
    args = ["--node", node.name]
    for cmd in setup:
        args += ["--setup", cmd]
    if image:  # built by the image's Python, in a container (dtrain.common.deps.ensure_in_image)
        args += ["--image", image, "--docker", node.docker]
    # Absolute paths (from the node's $PWD): the interpreter it prints is started from another folder.
    return (
        f'{shlex.quote(node.python)} -m dtrain.common.deps ensure --code-dir "$PWD/work" '
        f'--envs "$(cd ../.. && pwd)/envs" {shlex.join(args)}'
    )


def deps_command(setup: tuple[str, ...], image: str = "", *, info: bool = False) -> Any:
    """A sync_workdir `receiver`: one process per node receives the code, then makes or reuses the environment
    (deps_args), then, with `info` and nothing to install, prints what `nodeagent info --cached` would."""

    def line(node: Node, dest: str, snapshot: str) -> str:
        extra = ["--sync-dest", dest, "--sync-snapshot", snapshot]
        extra += ["--info-addr", node.address, "--info-workdir", "../.."] if info else []
        return f"{deps_args(node, setup, image)} {shlex.join(extra)}"

    return line


def deps_result(results: dict[str, str], events: Events) -> dict[str, dict[str, Any]]:
    """What the deps line printed on each node (its first JSON line after the sync: EnvResult; "info": the
    `nodeagent info` line that may follow), and one "deps" event."""
    parsed: dict[str, dict[str, Any]] = {}
    for n, out in results.items():
        lines = [x for x in out.strip().splitlines() if x.startswith("{")]
        parsed[n] = {**json.loads(lines[0]), "info": lines[1] if len(lines) > 1 else None}
    made = [n for n, r in parsed.items() if r.get("created")]
    keys = {r.get("key") for r in parsed.values() if r.get("key")}
    if keys:
        how = f"installed on {', '.join(made)}" if made else "reused on every node"
        events.emit("deps", f"requirements {how} (env {', '.join(sorted(keys))})", created=made, keys=sorted(keys))
    return parsed


def launch_program_cluster(plan: Any, *, events: Events, handle: Handle) -> int:
    """Run the program of `plan` (a launchers.Plan) on every node of its cluster; returns the job's exit code."""
    import dataclasses

    req, job, t, cluster = plan, plan.job, plan.target, plan.cluster
    nproc, max_restarts = plan.nproc, plan.max_restarts
    if len(cluster.nodes) > 1 and not is_remote(t.run.url) and not cluster.shared_fs:
        raise UserError(
            f"a run on {len(cluster.nodes)} nodes needs --output that every node reaches: a gs://bucket/prefix "
            f"(or set shared_fs = true in [clusters.{cluster.name}] if it is a shared filesystem)"
        )
    image = cluster.image  # container mode (--image is the cluster's by now: launch.resolve)
    exclude = sync_excludes(job, t.run.url) if job.workdir is not None else []
    archive, digest = code_archive()  # in container mode too: the agent inside, the SDK and the mirror
    logs = LogFiles(t.run_id, t.run)
    resources = Recorder(t.run)  # the agents' "resources" lines: the run's curves and its ranks' peaks
    code, hung = int(ExitCode.FAILURE), ""
    terminated = False
    attempt = 0
    try:
        with SSH(cluster, accept_new_host_keys=req.accept_new_host_keys) as ssh:
            t0 = time.monotonic()
            # The first command opens the connection to every node (its errors name the node): no `true` first.
            sync_code(ssh, t.run_id, archive)
            if image:
                check_docker(ssh)
                events.info(f"pulled {image} on {len(cluster.nodes)} node(s) in {pull_image(ssh, image):.1f} s")
            torchrun = job.program.under_torchrun
            container = bool(image) or not torchrun
            # While the code goes out and the environment is checked (one process per node, in one SSH session,
            # which also reports the node's Python, torch, CPUs and GPUs when the job runs on that Python), the
            # rendezvous port is checked: neither touches what the other does.
            infos: dict[str, NodeInfo] | None = None
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                port_checked = pool.submit(
                    check_port, ssh, t.run_id, cluster.master, cluster.rdzv_port, cluster.nodes[1:], "rendezvous"
                )
                if job.workdir is not None:  # a built-in's code is dtrain's own, synced above
                    receiver = deps_command(job.setup, image, info=not image)
                    out = sync_workdir(ssh, t, job.workdir, exclude, events, limit_mb=job.code_limit_mb,
                                       receiver=receiver)  # fmt: skip
                    envs = deps_result(out, events)
                    pythons = {n: str(r["python"]) for n, r in envs.items()}
                    if all(r["info"] for r in envs.values()):
                        infos = {n.name: NodeInfo.parse(n, envs[n.name]["info"]) for n in cluster.nodes}
                else:  # the node's Python, or in container mode the image's (as deps.ensure_in_image gives it)
                    pythons = {n.name: "python3" if image else n.python for n in cluster.nodes}
                port_checked.result()
            nodes = tuple(dataclasses.replace(n, python=pythons[n.name]) for n in cluster.nodes)
            cluster = dataclasses.replace(cluster, nodes=nodes)
            ssh.cluster = cluster
            if infos is None:  # a built-in, or the job's own environment (its requirements): ask that Python
                infos = node_infos(ssh, t.run_id, container=container)
            else:
                infos = checked_infos(cluster, infos, container=container)
            m = infos[cluster.master.name]
            n = 1
            if torchrun:
                n = nproc or processes(0, gpus=m.gpus, cpus=m.cpus, oversubscribe=False)
                for node in cluster.nodes:
                    i = infos[node.name]
                    processes(n, gpus=i.gpus, cpus=i.cpus, oversubscribe=req.oversubscribe, where=f"node {node.name}")
            before = record_start(
                plan,
                cluster=cluster.name,
                nodes=len(cluster.nodes),
                nproc=n,
                hosts=tuple(x.name for x in cluster.nodes),
            )
            while True:
                if attempt:  # the first attempt's was checked above
                    check_port(ssh, t.run_id, cluster.master, cluster.rdzv_port, cluster.nodes[1:], "rendezvous")
                restore = t.resumed or attempt > 0
                target = dataclasses.replace(t, restarts=t.restarts + attempt)
                specs = {
                    node.name: program_spec(req, target, cluster, node, rank=i, nproc=n,
                                            threads=max(1, infos[node.name].cpus // n), restore=restore,
                                            gpus=max(infos[node.name].gpus, node.gpus))
                    for i, node in enumerate(cluster.nodes)
                }  # fmt: skip
                events.emit(
                    "launch",
                    f"{'resuming' if restore else 'starting'} {job.name} run {t.run_id} on cluster {cluster.name}: "
                    f"{len(cluster.nodes)} node(s)"
                    + (f" x {n} process(es) under torchrun" if torchrun else ", the command once per node")
                    + (f", image {image}" if image else "")
                    + f", dtrain code {digest} (ready in {time.monotonic() - t0:.1f} s)"
                    + (f": {plan.line}" if plan.line else ""),
                    run_id=t.run_id,
                    workload=job.name,
                    nodes=len(cluster.nodes),
                    nproc=n,
                )
                running = Job(ssh, cluster, t.run_id, specs, logs, events=events, handle=handle, tail=8,
                              resources=resources)  # fmt: skip
                code = running.run()
                hung = running.hang_error() if code == int(ExitCode.HUNG) else ""
                terminated = terminated or running.terminated
                if not running.interrupted and code != ExitCode.HUNG:
                    # Asked to stop (by dtrain, or a node's processes by the cloud), and it did: safe to resume.
                    code = job_outcome(code, running.codes.values(), asked=terminated)
                for node in cluster.nodes:
                    logs.write(node.name, f"{JOB_ENDED} (exit {running.codes.get(node.name, code)})")
                if code not in (0, int(ExitCode.USAGE), int(ExitCode.PREEMPTED)) and not running.interrupted:
                    running.report_failure(events)
                retry = code not in (0, int(ExitCode.USAGE), int(ExitCode.PREEMPTED)) and not running.interrupted
                if not retry or attempt >= max_restarts:
                    break
                attempt += 1
                events.info(
                    f"dtrain: the job failed (exit {code}); relaunching it on every node from its last checkpoint "
                    f"copy (restart {attempt} of {max_restarts})"
                )
                t0 = time.monotonic()
    finally:
        logs.close(t.run)
        # its last rows and the peaks, before the end is recorded (both write status.json); none for a refusal
        resources.close(refused=code == ExitCode.USAGE)
        if t.run.exists("config.json"):
            if attempt or t.resumed:
                update_status(t.run, {"starts": t.restarts + attempt + 1})
            code = record_end(t, code, hung, before)
    return code


def program_spec(
    req: Any,
    t: Target,
    cluster: Cluster,
    node: Node,
    *,
    rank: int,
    nproc: int,
    threads: int,
    restore: bool,
    gpus: int = 0,
) -> dict[str, Any]:
    """What `nodeagent run` starts on `node` for a launchers.Plan's program (remote.node_spec, with the
    program's part as data): dtrain's variables, its checkpoint directory put back and copied, its metrics."""
    job = req.job
    ckpt = f"work/{job.checkpoint_dir}" if job.checkpoint_dir else "checkpoints"
    work = "work" if job.workdir is not None else "."  # a built-in has no working directory: the run's own
    contract = contract_env(
        t, checkpoint_dir=ckpt, metrics_file="metrics.jsonl", stop_file="STOP", code_dir=work, node_rank=rank,
        nnodes=len(cluster.nodes), nproc=nproc, master_addr=cluster.master.address, master_port=cluster.rdzv_port,
        command=not job.program.under_torchrun,
    )  # fmt: skip
    files = {
        "checkpoint_dir": ckpt,
        "stop_file": "STOP",
        "metrics_file": "metrics.jsonl",
        "code_dir": work,
        "mirror": {
            "store": t.run.child(CKPT_PREFIX).url,
            "node": rank,
            "restore": restore,
            "interval_s": MIRROR_INTERVAL_S,
        },
        "forward": [{"local": "metrics.jsonl", "store": t.run.url, "rel": "metrics.jsonl"}] if rank == 0 else [],
    }
    torchrun = job.program.under_torchrun
    spec = NodeWork(
        tail=job.program.torchrun_tail() if torchrun else job.program.command_argv(),
        torchrun=torchrun,
        env={**job.env, **contract},
        grace_s=req.grace_s,
        hang=hang_spec(getattr(req, "hang_timeout", None), getattr(req, "startup_timeout", None)),
        files=files,
        cwd=work,
        mounts=getattr(req, "mounts", ()),
        run_url=t.run.url,
        debug=req.debug,
        sample_interval=getattr(req, "sample_interval", SAMPLE_EVERY_S),
    )
    return node_spec(cluster, node, spec, run_id=t.run_id, nproc=nproc, threads=threads, gpus=gpus)


__all__ = ["launch_program_cluster", "program_spec", "project_key"]
