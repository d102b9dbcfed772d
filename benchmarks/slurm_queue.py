"""Slurm's costs on the test bed (scripts/slurmbed.py, real slurmctld/slurmd/munged across network
namespaces; needs root): the figures in docs/decisions.md.

    sudo .venv/bin/python benchmarks/slurm_queue.py [--rounds 3] [--only start,crash,speed] [--json out.json]

Four hosts: h0 and h1 are cluster `bed` (slurm = true, Slurm set up by dtrain), h2 and h3 cluster `direct`
(the same kind of hosts, no Slurm: `dtrain train` over SSH). The two paths run at the same time, one on
each pair, so that the load of this shared machine, which moves by a factor of several within minutes,
falls on both alike.

- start: from calling `dtrain train mnist` to rank 0's first reported training step, through Slurm and
  directly. Taken where the user sees it: the first progress event past step 0 the control layer reports
  (rank 0 reports every step, at most every 0.5 s, on both paths). The runs are then interrupted.
- crash: a 2-node job through Slurm on h0 and h1 (alone); once its first checkpoint is written every
  process of h1 is killed and h1 comes back a second later (sshd, munged, slurmd, as a reboot would);
  from the kill to the first training step after the job resumed, and to its requeue.
- speed: the same run queued (`dtrain submit`) and direct (`dtrain train --cluster direct`), both running
  at once. images/s: the median of samples_per_s over the metrics windows (every 5 steps) that fall in the
  time both were training; on this shared machine it moves with the load. images per CPU-second: those
  images/s over the CPU the job's processes spent meanwhile (on its hosts, every process that lived
  through the window: workers, torchrun, the agents, and for the queued job its batch step, node tasks,
  srun and slurmstepd; not the daemons, which the benchmark's own polling keeps busy), which the
  machine's other load does not change.

Every run: Fashion-MNIST, 2 nodes x 1 process, global batch 256. The machine's load average is printed
with the figures.
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
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from slurmbed import SlurmBed  # noqa: E402

from dtrain.control.events import Event, Events, Handle  # noqa: E402
from dtrain.control.launch import LaunchRequest, launch  # noqa: E402

MNIST = {"mnist.dataset": "fashion-mnist", "run.nproc": 1, "mnist.batch_size": 256}
CRASH_CHECKPOINT = 8
SPEED_FLAGS = {"mnist.epochs": 1, "mnist.train_split": "train[:32000]", "run.log_every": 5}


class Recorder(Events):
    """Events with the time each arrived."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, Event]] = []
        super().__init__(lambda ev: self.seen.append((time.monotonic(), ev)))

    def first(self, kind: str, after: float = 0.0, where=lambda ev: True) -> float | None:
        return next((t for t, ev in self.seen if t >= after and ev.kind == kind and where(ev)), None)

    def run_id(self) -> str:
        return next(ev.data["run_id"] for _t, ev in self.seen if ev.kind == "launch")


def stepped(ev: Event) -> bool:
    return (ev.data.get("completed") or 0) >= 1


def request(cluster: str, output: Path, **flags: Any) -> LaunchRequest:
    return LaunchRequest(workload="mnist", flags={**MNIST, "run.cluster": cluster, "run.output": str(output), **flags})


def first_step(cluster: str, output: Path, results: dict[str, float]) -> None:
    """Seconds from the call to the first training step (into results[cluster]); the run is then interrupted."""
    events, handle = Recorder(), Handle()
    t0 = time.monotonic()
    # log_every 1: rank 0 reports progress from the first step on (at most every 0.5 s, on either path)
    req = request(cluster, output, **{"mnist.epochs": 1, "mnist.train_split": "train[:16000]", "run.log_every": 1})
    worker = threading.Thread(target=launch, args=(req,), kwargs={"events": events, "handle": handle}, daemon=True)
    worker.start()
    while (t := events.first("progress", where=stepped)) is None:
        if not worker.is_alive():
            raise RuntimeError(
                f"{cluster}: the run ended before its first step: {[e.message for _t, e in events.seen]}"
            )
        time.sleep(0.05)
    results[cluster] = t - t0
    handle.interrupt()
    worker.join(timeout=300)


def together(*calls: Any) -> None:
    """Run the calls at the same time; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def crash_to_training(sb: SlurmBed, output: Path) -> dict[str, float]:
    events, handle = Recorder(), Handle()
    req = request("bed", output, **{"mnist.epochs": 1, "mnist.train_split": "train[:16000]", "run.log_every": 1,
                                    "run.checkpoint_every": CRASH_CHECKPOINT})  # fmt: skip
    worker = threading.Thread(target=launch, args=(req,), kwargs={"events": events, "handle": handle}, daemon=True)
    worker.start()
    while not any(ev.kind == "launch" for _t, ev in events.seen):
        time.sleep(0.1)
    latest = output / events.run_id() / "checkpoints" / "LATEST"
    while not latest.exists():
        if not worker.is_alive():
            raise RuntimeError("the job ended before its first checkpoint")
        time.sleep(0.05)
    h1 = sb.host("h1")
    t_crash = time.monotonic()
    sb.crash(h1)
    time.sleep(1.0)
    sb.revive(h1)
    t_back = time.monotonic()
    deadline = time.monotonic() + 600
    while (t_resumed := events.first("output", t_crash, lambda ev: "resuming from" in ev.message)) is None:
        if time.monotonic() > deadline or not worker.is_alive():
            raise RuntimeError(f"never resumed: {[e.message for _t, e in events.seen][-20:]}")
        time.sleep(0.1)
    while (t_step := events.first("progress", t_resumed, stepped)) is None:
        time.sleep(0.05)
    requeued = events.first("stage", t_crash, lambda ev: "requeued" in ev.message)
    handle.interrupt()
    worker.join(timeout=300)
    return {
        "crash_to_training_s": t_step - t_crash,
        "crash_to_requeued_s": (requeued - t_crash) if requeued else float("nan"),
        "node_back_after_s": t_back - t_crash,
    }


def metrics(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if "samples_per_s" in r][1:]  # the first window warms up


def queued_run(output: Path, results: dict[str, Path]) -> None:
    from dtrain.control.launch import submit
    from dtrain.control.settings import load_cluster
    from dtrain.control.slurm.joblist import list_jobs

    r = submit(request("bed", output, **SPEED_FLAGS), events=Events(), handle=Handle())
    cluster = load_cluster(None, "bed")
    while True:
        row = next(j for j in list_jobs(cluster, all_jobs=True) if j.record.job_id == r.job_id)
        if row.state is not None and row.state.settled:
            break
        time.sleep(2)
    assert row.state.state == "COMPLETED", row.state
    results["queued"] = output / r.run_id


def direct_run(output: Path, results: dict[str, Path]) -> None:
    result = launch(request("direct", output, **SPEED_FLAGS), events=Events(), handle=Handle())
    assert result.exit_code == 0, result
    results["direct"] = output / result.run_id


class CpuSampler(threading.Thread):
    """Every second, the CPU time so far of every process of the given hosts (by network namespace)."""

    def __init__(self, sb: SlurmBed, hosts: dict[str, list[str]]) -> None:
        super().__init__(daemon=True)
        self.sb, self.hosts = sb, hosts
        self.samples: list[tuple[float, dict[str, dict[int, int]]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.time()
            self.samples.append((now, {name: self._ticks(hosts) for name, hosts in self.hosts.items()}))
            self.done.wait(1.0)

    def _ticks(self, hosts: list[str]) -> dict[int, int]:
        out = {}
        for h in hosts:
            for pid in self.sb.bed.pids(self.sb.host(h)):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if any(b"dtrain." in c for c in cmd) or cmd[0].startswith((b"slurmstepd", b"srun")):
                    out[pid] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    def rate(self, name: str, lo: float, hi: float) -> float:
        """CPU-seconds per second the hosts of `name` spent between lo and hi (processes alive throughout)."""
        (t0, a), (t1, b) = (
            next(x for x in self.samples if x[0] >= lo),
            next(x for x in reversed(self.samples) if x[0] <= hi),
        )
        ticks = sum(b[name][pid] - a[name][pid] for pid in a[name].keys() & b[name].keys())
        return ticks / os.sysconf("SC_CLK_TCK") / (t1 - t0)


def speeds(runs: dict[str, Path], cpu: CpuSampler) -> dict[str, float]:
    """Each run's median images/s over the windows logged while both were training, and its images per
    CPU-second over that time."""
    rows = {name: metrics(run) for name, run in runs.items()}
    lo = max(r[0]["time"] for r in rows.values())
    hi = min(r[-1]["time"] for r in rows.values())
    out = {}
    for name, rs in rows.items():
        both = [r["samples_per_s"] for r in rs if lo <= r["time"] <= hi]
        out[name] = statistics.median(both)
        out[f"{name}_windows"] = len(both)
        out[f"{name}_per_cpu_s"] = out[name] / cpu.rate(name, lo, hi)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="start,crash,speed")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if reason := SlurmBed.available():
        print(f"cannot make a Slurm bed here: {reason}", file=sys.stderr)
        return 2
    wanted = set(args.only.split(","))
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="dtrain-slurm-bench-") as tmp, SlurmBed.create(4, Path(tmp) / "bed") as sb:
        cwd = Path(tmp) / "cwd"
        cwd.mkdir()
        bed = sb.hosts_toml("bed", sys.executable, nodes=2)
        direct = sb.hosts_toml("direct", sys.executable, nodes=2, first=2, slurm=False)
        (cwd / "dtrain.toml").write_text(bed + "\n" + direct)
        os.chdir(cwd)
        os.environ.update(XDG_CONFIG_HOME=str(cwd / "config"), XDG_CACHE_HOME=str(cwd / "cache"), DTRAIN_OFFLINE="1")
        from dtrain.control.settings import load_cluster
        from dtrain.control.slurm.setup import setup

        assert [n.name for n in load_cluster(None, "direct").nodes] == ["h2", "h3"]
        setup(load_cluster(None, "bed"), events=Events(), handle=Handle())
        runs = sb.shared / "runs"
        runs.mkdir()
        if "start" in wanted:
            rows = []
            for i in range(args.rounds):
                got: dict[str, float] = {}
                together(partial(first_step, "bed", runs, got), partial(first_step, "direct", runs, got))
                rows.append({"slurm": got["bed"], "direct": got["direct"]})
                print(f"start round {i + 1}: direct {got['direct']:.2f} s, slurm {got['bed']:.2f} s", flush=True)
            out["start"] = {
                "rounds": rows,
                "median_direct_s": statistics.median(r["direct"] for r in rows),
                "median_slurm_s": statistics.median(r["slurm"] for r in rows),
                "median_extra_s": statistics.median(r["slurm"] - r["direct"] for r in rows),
            }
        if "crash" in wanted:
            out["crash"] = [crash_to_training(sb, runs) for _ in range(args.rounds)]
            for r in out["crash"]:
                print("crash: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
        if "speed" in wanted:
            rows = []
            for i in range(args.rounds):
                got_runs: dict[str, Path] = {}
                cpu = CpuSampler(sb, {"queued": ["h0", "h1"], "direct": ["h2", "h3"]})
                cpu.start()
                together(partial(queued_run, runs, got_runs), partial(direct_run, runs, got_runs))
                cpu.done.set()
                cpu.join()
                rows.append(speeds(got_runs, cpu))
                r = rows[-1]
                print(f"speed round {i + 1}: queued {r['queued']:.0f}, direct {r['direct']:.0f} images/s "
                      f"({r['queued_windows']} and {r['direct_windows']} windows); per CPU-second: queued "
                      f"{r['queued_per_cpu_s']:.0f}, direct {r['direct_per_cpu_s']:.0f}", flush=True)  # fmt: skip
            out["speed"] = {
                "rounds": rows,
                "median_ratio": statistics.median(r["queued"] / r["direct"] for r in rows),
                "median_ratio_per_cpu_s": statistics.median(
                    r["queued_per_cpu_s"] / r["direct_per_cpu_s"] for r in rows
                ),
            }
        out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
