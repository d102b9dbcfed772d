"""Driving the dashboard from tests: a real `dtrain dashboard` process (uvicorn on a port of its own
choosing, read back from what it prints), real `dtrain train mnist` runs on data the tests write,
and waiting on both."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from runs import CLI, isolated_env

CHROMIUM = "/usr/bin/chromium"
# What keeps a headless chromium off the (closed) network and quick to start.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip
START_TIMEOUT_S = 90  # a loaded machine takes a while to import fastapi and list the runs
STOP_TIMEOUT_S = 30
URL_RE = re.compile(r"dashboard: (http://\S+/) for")
# The training runs: tiny data, one process, a line per step. The MNIST CNN at batch 16 on a loaded
# 2-core machine takes 0.05-0.5 s a step.
TRAIN_IMAGES, TEST_IMAGES, BATCH = 256, 64, 16
STEPS_PER_EPOCH = TRAIN_IMAGES // BATCH


class Server:
    """A `dtrain dashboard` process: its URL once it listens, everything it printed, and stop()."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if not self.url and (m := URL_RE.search(line)):
                self.url = m.group(1).rstrip("/")
                self._ready.set()
        self._ready.set()

    def wait_ready(self) -> Server:
        if not self._ready.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            pytest.fail(f"dtrain dashboard did not start (rc {self.proc.returncode}):\n{self.output}")
        return self

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        """Its exit code, once it has exited and all it printed is in `lines`."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def stop(self) -> int:
        """SIGTERM (what a service manager sends), as Ctrl-C would stop it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"dtrain dashboard did not stop within {STOP_TIMEOUT_S} s of SIGTERM:\n{self.output}")
        return self.wait(STOP_TIMEOUT_S)


def start_dashboard(cwd: Path, output: str | Path, *args: str, env: dict[str, str]) -> Server:
    """`dtrain dashboard --output OUTPUT --port 0 ARGS` (not yet waited for: call wait_ready())."""
    proc = subprocess.Popen(
        [*CLI, "dashboard", "--output", str(output), "--port", "0", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Server(proc)


def dashboard_env(home: Path, **extra: str) -> dict[str, str]:
    """An isolated environment whose dtrain config dir (the token's place) is under `home`."""
    return isolated_env(home, XDG_CONFIG_HOME=str(home / "config"), XDG_CACHE_HOME=str(home / "xdg-cache"),
                        COLUMNS="250", **extra)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# training runs


def train_argv(data: Path, output: str | Path, epochs: int, *extra: str) -> list[str]:
    return [*CLI, "train", "mnist", "--data-dir", str(data), "--output", str(output), "--epochs", str(epochs),
            "--nproc", "1", "--batch-size", str(BATCH), "--log-every", "1", *extra]  # fmt: skip


def start_training(data: Path, output: str | Path, epochs: int, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_argv(data, output, epochs),
        cwd=cwd,
        env=isolated_env(cwd, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop_training(proc: subprocess.Popen) -> str:
    """Ctrl-C: the run records itself as interrupted (and saves a checkpoint)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    return out


def copy_runs(src: Path, dest: Path) -> Path:
    """A writable copy of an output directory (tests that add or spoil files use their own)."""
    shutil.copytree(src, dest)
    return dest


def metric_lines(run: Path) -> list[dict]:
    """metrics.jsonl's complete lines, as the run wrote them."""
    text = (run / "metrics.jsonl").read_text()
    return [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln.strip()]


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


# ---------------------------------------------------------------------------------------------
# the browser


def keep_screenshot(pg, tmp_path: Path, name: str) -> Path:
    """A screenshot under the test's tmp dir, copied to $DTRAIN_TEST_ARTIFACTS when that is set."""
    shot = tmp_path / f"{name}.png"
    pg.screenshot(path=str(shot), full_page=True)
    if target := os.environ.get("DTRAIN_TEST_ARTIFACTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(target) / shot.name)
    return shot
