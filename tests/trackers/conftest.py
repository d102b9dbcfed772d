"""A real MLflow tracking server on loopback (started here, stopped by its pid), and a reader for what W&B wrote
in offline mode (its run-<id>.wandb record log: LevelDB's log format, W&B's protobuf records)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dtrain.common.procs import dies_with_parent

SERVER_START_S = 90.0  # a cold `mlflow server` imports a lot; on a busy 2-core machine it has taken ~20 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """The URL of an MLflow tracking server (mlflow's own `mlflow server`, a SQLite store in a temp folder)."""
    pytest.importorskip("mlflow", reason="needs mlflow (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    # No job execution: MLflow 3 otherwise starts a job runner and seven huey consumers beside the server, which
    # tracking does not use. The server dies with this process (a killed pytest leaves no server behind) and
    # passes the signal on to its uvicorn worker.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        preexec_fn=dies_with_parent(signal.SIGTERM),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        # Its own session: the server and the workers it forked, by the pid we started.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # it has nothing to keep: a slow graceful stop is not waited for
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def wandb_runs(directory: Path) -> list[Path]:
    """The offline run folders W&B wrote under `directory` (its wandb/ folder), oldest first."""
    return sorted((directory / "wandb").glob("offline-run-*"))


def wandb_records(run_dir: Path) -> list:
    """The records of an offline run's run-<id>.wandb: a 7-byte W&B header, then LevelDB log blocks of 32 KiB
    whose records (7-byte header: crc, length, type FULL/FIRST/MIDDLE/LAST) hold protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, part, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The rows an offline run logged (wandb.log), each {key: value}."""
    import json

    rows = []
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def wandb_run_id(run_dir: Path) -> str:
    (run,) = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    return run.run_id
