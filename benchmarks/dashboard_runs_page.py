"""The Runs page's server time with 1,000 runs (issue 17's target: 300 ms or less).

Makes N run directories shaped as `dtrain train` leaves them (config.json, status.json, metrics.jsonl
with a line per step and an evaluation per epoch, events.jsonl, two checkpoints with their meta.json
and LATEST), most of them ended and a few running (their pid is this script's, so they count as
alive and are read afresh on every request). Then it starts the real `dtrain dashboard` on them and
asks for the Runs page R times: the first request reads every run, the next ones answer ended runs
from memory. Server time is what the dashboard's access log measures (request in to response
start: the whole page is rendered by then); the client's round trip is printed beside it.

Last, it times the parts in this process to say what dominates: listing and summarising the runs
(cold and warm), filtering and sorting, rendering the template.

    python benchmarks/dashboard_runs_page.py [--runs 1000] [--requests 20] [--lines 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]
RUNNING_EVERY = 100  # one run in this many is still running
STATES = ("completed", "completed", "completed", "failed", "preempted", "interrupted")


def make_runs(out: Path, n: int, lines: int) -> None:
    """N runs under `out`, as dtrain train writes them (the checkpoints' state.pt are stand-ins of the
    size meta.json records)."""
    t0 = 1_767_225_600.0  # 2026-01-01
    for i in range(n):
        created = t0 + i * 600
        run_id = f"mnist-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(created))}-{secrets.token_hex(2)}"
        run = out / run_id
        (run / "checkpoints").mkdir(parents=True)
        running = i % RUNNING_EVERY == 0
        state = "running" if running else STATES[i % len(STATES)]
        host = os.uname().nodename
        config = {"workload": "mnist", "run_id": run_id, "created": created, "world_size": 2,
                  "config": {"epochs": 4, "batch_size": 256, "seed": i}, "model_config": {"width": 16}}  # fmt: skip
        status = {"state": state, "exit_code": None if running else 0, "updated": created + 300,
                  "host": host, "pid": os.getpid(), "peers": [{"rank": 0, "host": host}]}  # fmt: skip
        (run / "config.json").write_text(json.dumps(config, indent=2))
        (run / "status.json").write_text(json.dumps(status, indent=2))
        rows = []
        per_epoch = max(1, lines // 4)
        for step in range(1, lines + 1):
            rows.append({"step": step, "time": created + step, "loss": 2.3 / step**0.3, "lr": 0.003,
                         "epoch": step / per_epoch, "samples_per_s": 5000.0})  # fmt: skip
            if step % per_epoch == 0:
                rows.append({"step": step, "time": created + step, "epoch": step // per_epoch,
                             "eval_accuracy": 0.8 + 0.01 * (step // per_epoch), "eval_loss": 0.5})  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        events = [{"time": created, "step": 0, "event": "started", "message": "started on 2 process(es)"}]
        for step in (per_epoch * 3, per_epoch * 4):
            name = f"step-{step:08d}"
            (run / "checkpoints" / name).mkdir()
            (run / "checkpoints" / name / "state.pt").write_bytes(b"\0" * 1024)
            meta = {"step": step, "files": {"state.pt": {"size": 1024, "sha256": ""}}, "created": created + step}
            (run / "checkpoints" / name / "meta.json").write_text(json.dumps(meta))
            events.append({"time": created + step, "step": step, "event": "checkpoint", "message": f"saved {step}"})
        (run / "checkpoints" / "LATEST").write_text(name)
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def serve_and_measure(out: Path, requests: int) -> tuple[list[float], list[float]]:
    """Server times (ms, from the access log) and client round trips (ms) of GET / on a real dashboard."""
    import httpx

    proc = subprocess.Popen([*CLI, "dashboard", "--output", str(out), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "250"})  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "dashboard: http://" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(600) or proc.poll() is not None:
            sys.exit(f"dtrain dashboard did not start:\n{''.join(lines)}")
        url = re.search(r"dashboard: (http://\S+/)", "".join(lines)).group(1)
        rounds = []
        with httpx.Client(base_url=url, timeout=600) as c:
            for _ in range(requests):
                t = time.perf_counter()
                answer = c.get("/")
                rounds.append((time.perf_counter() - t) * 1000)
                assert answer.status_code == 200 and answer.text.count('<tr data-run="') > 0
        time.sleep(0.5)
        served = [float(m.group(1)) for m in re.finditer(r"GET / 200 (\d+) ms", "".join(lines))]
        return served, rounds
    finally:
        proc.terminate()
        proc.wait(60)


def parts(out: Path) -> dict[str, float]:
    """ms of each part of the page, measured in this process (a fresh summary memory first)."""
    from fastapi.templating import Jinja2Templates  # noqa: F401 - imported before timing

    from dtrain.control import runs
    from dtrain.dashboard import pages, table

    runs._summaries.clear()
    t = time.perf_counter()
    rows = runs.runs_table(str(out))
    cold = time.perf_counter() - t
    t = time.perf_counter()
    rows = runs.runs_table(str(out))
    warm = time.perf_counter() - t
    t = time.perf_counter()
    names = runs._run_names(runs.open_store(str(out)))
    listing = time.perf_counter() - t
    t = time.perf_counter()
    query = table.Query()
    shown = table.select(rows, query)
    select = time.perf_counter() - t
    template = pages.templates.get_template("runs.html")
    t = time.perf_counter()
    html = template.render(request=None, output=str(out), cluster_name=None, query=query, rows=shown, total=len(rows),
                           statuses=[], workloads=[], columns=list(table.SORT_KEYS), compare_max=8)  # fmt: skip
    render = time.perf_counter() - t
    assert len(names) == len(rows) and html.count('<tr data-run="') == len(rows)
    return {"summaries, cold (every run read)": cold * 1000, "summaries, warm": warm * 1000,
            "  of which listing run directories": listing * 1000, "filter and sort": select * 1000,
            "render the template": render * 1000, "page size (KiB)": len(html.encode()) / 1024}  # fmt: skip


def stats(ms: list[float]) -> str:
    return f"median {statistics.median(ms):7.1f}  min {min(ms):7.1f}  max {max(ms):7.1f}  (n={len(ms)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--lines", type=int, default=200, help="metrics lines of training per run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        out = Path(tmp) / "runs"
        t = time.perf_counter()
        make_runs(out, args.runs, args.lines)
        print(f"made {args.runs} runs ({args.lines} metrics lines each) in {time.perf_counter() - t:.1f} s")
        served, rounds = serve_and_measure(out, args.requests)
        print(f"GET / with {args.runs} runs, ms    (target: 300 ms or less, warm)")
        print(f"  server, first request (cold)   {served[0]:7.1f}")
        print(f"  server, later requests (warm)  {stats(served[1:])}")
        print(f"  client round trip (warm)       {stats(rounds[1:])}")
        print("parts, in this process, ms:")
        for name, value in parts(out).items():
            print(f"  {name:38s} {value:8.1f}")


if __name__ == "__main__":
    main()
