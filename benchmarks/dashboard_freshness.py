"""How fresh the dashboard's metrics are: from a metrics line being logged (the "time" the workload
stamps on it) to `GET /api/v1/runs/{id}/metrics` serving it, for a run in a local directory and for
one in a bucket (gcp-storage-emulator, started here).

For each location it starts the real `dtrain train mnist` (Fashion-MNIST from Debian's
dataset-fashion-mnist, 1 process, a line every step) and the real `dtrain dashboard`, polls the API
every POLL_S and notes, for each line that appears, how long ago it was logged. Lines already there at
the first poll are left out (they predate the measurement). The poll interval itself adds up to
POLL_S to each figure.

    python benchmarks/dashboard_freshness.py [--lines 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]
FASHION = Path("/usr/share/datasets/fashion-mnist")
POLL_S = 0.1
TRAIN = ["train", "mnist", "--dataset", "fashion-mnist", "--data-dir", str(FASHION), "--train-split", "train[:4096]",
         "--epochs", "50", "--nproc", "1", "--batch-size", "32", "--log-every", "1"]  # fmt: skip


def start(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def measure(output: str, env: dict[str, str], cwd: Path, want: int) -> list[float]:
    import httpx

    job, job_out = start([*TRAIN, "--output", output], env, cwd)
    server, server_out = start(["dashboard", "--output", output, "--port", "0"], env, cwd)
    lags: list[float] = []
    try:
        deadline = time.monotonic() + 600
        while not (m := re.search(r"dashboard: (http://\S+/)", "".join(server_out))):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"dtrain dashboard did not start:\n{''.join(server_out)}")
            time.sleep(0.1)
        with httpx.Client(base_url=m.group(1), timeout=120) as c:
            run_id, after, first = None, 0, True
            while len(lags) < want:
                if job.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the run ended before {want} lines were seen:\n{''.join(job_out)}")
                if run_id is None:
                    found = c.get("/api/v1/runs").json()["runs"]
                    run_id = found[0]["run_id"] if found else None
                else:
                    page = c.get(f"/api/v1/runs/{run_id}/metrics", params={"after_line": after}).json()
                    now = time.time()
                    if not first:
                        lags += [now - r["time"] for r in page["rows"] if "time" in r]
                    first = first and not page["rows"]
                    after = page["lines"]
                time.sleep(POLL_S)
    finally:
        for p in (job, server):
            p.send_signal(2)
        for p in (job, server):
            p.wait(120)
    return lags


def emulator(workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "HOST", "PORT")}
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
           "--in-memory", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=workdir, env={**env, "STORAGE_BASE": str(workdir)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    sys.exit("the storage emulator did not start")


def summary(lags: list[float]) -> dict[str, float]:
    ordered = sorted(lags)
    return {"lines": len(lags), "median_s": round(statistics.median(lags), 2),
            "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 2), "max_s": round(max(lags), 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=60, help="lines to time at each location")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        sys.exit("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="dtrain-fresh-") as tmp:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
        env = {**base, "DTRAIN_OFFLINE": "1", "COLUMNS": "250"}
        results["local"] = summary(measure(str(Path(tmp) / "runs"), env, Path(tmp), args.lines))
        print("local directory:", results["local"], flush=True)
        emu, host = emulator(Path(tmp))
        try:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            bucket = f"dtrain-bench-{uuid.uuid4().hex[:8]}"
            os.environ["STORAGE_EMULATOR_HOST"] = host
            storage.Client(project="bench", credentials=AnonymousCredentials()).create_bucket(bucket)
            results["bucket"] = summary(
                measure(f"gs://{bucket}/runs", {**env, "STORAGE_EMULATOR_HOST": host}, Path(tmp), args.lines)
            )
            print("bucket (emulator):", results["bucket"], flush=True)
        finally:
            emu.kill()
            emu.wait()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
