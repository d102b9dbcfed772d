"""Preemption to training again, with the cluster service doing the recovery, on the Slurm test bed (real
slurmctld/slurmd/munged across network namespaces; needs root) with tests/gcp's Compute fake as the cloud.

    sudo .venv/bin/python benchmarks/service_recovery.py [--rounds 3] [--poll 10] [--json out.json]

A 2-node job through Slurm (`dtrain train --cluster bed`, Fashion-MNIST, 2 nodes x 1 process, global batch
256) on h0 and h1. Once its first checkpoint is written, h1 is preempted: every process of it is killed and
the fake marks it TERMINATED with a `compute.instances.preempted` operation. The service (dtrain.service,
polling every --poll seconds, 10 by default as on a cluster) sees the confirmed preemption, calls
instances.start; the fake's start hook brings h1 back (sshd, munged, slurmd); the service returns it to
Slurm; the requeued job resumes from its checkpoint. Measured: from the preemption to the first training
step rank 0 reports after the resume, and its parts (to the service's start call, to the node back in
Slurm).

What the bed does not have: a real VM's boot. On GCE a stopped VM takes tens of seconds to boot before
slurmd answers; add that to these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from gcp.compute_fake import ComputeWorld  # noqa: E402
from slurm_queue import CRASH_CHECKPOINT, Recorder, request, stepped  # noqa: E402
from slurmbed import SlurmBed  # noqa: E402

from dtrain.control.events import Collector, Events, Handle  # noqa: E402
from dtrain.control.launch import launch  # noqa: E402

PROJECT, ZONE = "dtrain-bench", "us-central1-a"


def one_round(sb: SlurmBed, output: Path, poll_s: float, state_dir: Path) -> dict[str, float]:
    from google.auth.credentials import AnonymousCredentials

    from dtrain.control.gcp.client import Gcp
    from dtrain.control.settings import load_cluster
    from dtrain.service.daemon import Service, ServiceConfig, SshShell

    world = ComputeWorld(PROJECT)
    world.polls_to_finish = 1
    world.add_region("us-central1", [ZONE])
    for h in ("h0", "h1"):
        world.add_instance(ZONE, h, labels={"dtrain-cluster": "bed"}, spot=h == "h1", internal_ip=sb.host(h).address)
    back: dict[str, float] = {}

    def on_start(zone: str, name: str) -> None:
        back["start_called"] = time.monotonic()
        sb.revive(sb.host(name))
        back["revived"] = time.monotonic()

    world.on_start = on_start
    with world.serve() as server:
        cluster = load_cluster(None, "bed")
        cfg = ServiceConfig(cluster="bed", project=PROJECT, zone=ZONE, master="h0", workers=["h1"],
                            workdir="/var/lib/slurm/dtrain", state_file=str(state_dir / "state.json"),
                            poll_s=poll_s, autostop="off")  # fmt: skip
        notes = Collector()
        service = Service(cfg, gcp=Gcp(PROJECT, AnonymousCredentials(), endpoint=server.endpoint),
                          shell=SshShell(cluster), events=notes)  # fmt: skip
        stop_service = Handle()
        svc = threading.Thread(target=service.run, args=(stop_service,), daemon=True)
        svc.start()
        events, handle = Recorder(), Handle()
        req = request("bed", output, **{"mnist.epochs": 1, "mnist.train_split": "train[:16000]", "run.log_every": 1,
                                        "run.checkpoint_every": CRASH_CHECKPOINT})  # fmt: skip
        job = threading.Thread(target=launch, args=(req,), kwargs={"events": events, "handle": handle}, daemon=True)
        job.start()
        try:
            while not any(ev.kind == "launch" for _t, ev in events.seen):
                time.sleep(0.1)
            latest = output / events.run_id() / "checkpoints" / "LATEST"
            while not latest.exists():
                if not job.is_alive():
                    raise RuntimeError("the job ended before its first checkpoint")
                time.sleep(0.05)
            t0 = time.monotonic()
            sb.crash(sb.host("h1"))
            world.mark_preempted(ZONE, "h1")
            deadline = t0 + 600
            while (t_resumed := events.first("output", t0, lambda ev: "resuming from" in ev.message)) is None:
                if time.monotonic() > deadline or not job.is_alive():
                    raise RuntimeError(f"never resumed: {[e.message for _t, e in events.seen][-20:]}")
                time.sleep(0.1)
            while (t_step := events.first("progress", t_resumed, stepped)) is None:
                time.sleep(0.05)
            resumed_at = next((time.monotonic() for e in notes.events if e.kind == "resumed"), None)
        finally:
            handle.interrupt()
            job.join(timeout=300)
            stop_service.terminate()
            svc.join(timeout=60)
    restarts = service.state.nodes["h1"].restarts
    return {
        "preemption_to_training_s": t_step - t0,
        "preemption_to_start_call_s": back.get("start_called", float("nan")) - t0,
        "preemption_to_node_revived_s": back.get("revived", float("nan")) - t0,
        "restarts": restarts,
        "resumed_noted": resumed_at is not None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--poll", type=float, default=10.0, help="the service's poll interval (s); 10 on a cluster")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if reason := SlurmBed.available():
        print(f"cannot make a Slurm bed here: {reason}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"load_before": os.getloadavg(), "poll_s": args.poll}
    with tempfile.TemporaryDirectory(prefix="dtrain-svc-bench-") as tmp, SlurmBed.create(2, Path(tmp) / "bed") as sb:
        cwd = Path(tmp) / "cwd"
        cwd.mkdir()
        (cwd / "dtrain.toml").write_text(sb.hosts_toml("bed", sys.executable, nodes=2))
        os.chdir(cwd)
        os.environ.update(XDG_CONFIG_HOME=str(cwd / "config"), XDG_CACHE_HOME=str(cwd / "cache"), DTRAIN_OFFLINE="1")
        from dtrain.control.settings import load_cluster
        from dtrain.control.slurm.setup import setup

        setup(load_cluster(None, "bed"), events=Events(), handle=Handle())
        runs = sb.shared / "runs"
        runs.mkdir()
        rows = []
        for i in range(args.rounds):
            r = one_round(sb, runs, args.poll, Path(tmp) / f"state-{i}")
            rows.append(r)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in r.items()), flush=True)  # fmt: skip
        out["rounds"] = rows
        out["median_preemption_to_training_s"] = statistics.median(r["preemption_to_training_s"] for r in rows)
        out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
