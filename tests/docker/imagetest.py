"""Docker for tests: reuse a running daemon or start Debian's dockerd as root (and stop it afterwards), make the
base image locally (scripts/docker-base.sh: debootstrap + docker import, since no registry can be pulled from),
and build Dockerfile.train once with `dtrain build --no-push` (tagged by content hash, so a later session with
the same sources finds it and builds nothing).

Every function returns a reason to skip (a string) or raises with the daemon's log; tests turn the reason into
pytest.skip so that a machine without root or docker.io says why.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
BASE_TAG = "dtrain-base:bookworm"
TORCH_WHEEL_DIRS = (Path("/opt/wheels"),)
START_TIMEOUT_S = 60.0
BUILD_TIMEOUT_S = 1500
LOG_DIR = Path("/tmp/dtrain-test-dockerd")
CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]


def docker(*args: str, timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p


def daemon_up(host: str | None = None) -> bool:
    argv = [DOCKER, *(["-H", host] if host else []), "info", "--format", "{{.ServerVersion}}"]
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        return subprocess.run(argv, capture_output=True, timeout=20, check=False, env=env).returncode == 0
    return False


class Daemon:
    """The machine's Docker daemon: reused if one answers, else started here (and stopped by stop())."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> str | None:
        if os.environ.get("DOCKER_HOST"):
            return "DOCKER_HOST is set: the docker tests use this machine's own daemon"
        if daemon_up():
            return None
        if os.geteuid() != 0:
            return "needs root to start dockerd (CI runs as root), or a running Docker daemon"
        if not Path(DOCKERD).exists() or not Path(DOCKER).exists():
            return "needs Debian's docker.io (apt-get install docker.io)"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = LOG_DIR / "dockerd.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([DOCKERD], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not daemon_up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                self.stop()
                raise RuntimeError("dockerd did not start:\n" + "\n".join(tail))
            time.sleep(0.5)
        return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def base_image() -> str | None:
    """The locally made base image (scripts/docker-base.sh); returns a reason to skip, or None."""
    if docker("image", "inspect", BASE_TAG, check=False).returncode == 0:
        return None
    if not shutil.which("debootstrap"):
        return "needs debootstrap to make the base image (apt-get install debootstrap)"
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "docker-base.sh"), BASE_TAG],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "DOCKER": DOCKER},
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"scripts/docker-base.sh failed:\n{p.stdout}\n{p.stderr}")
    return None


def torch_wheel() -> Path | None:
    for d in TORCH_WHEEL_DIRS:
        found = sorted(d.glob("torch-2.13.0+cpu-cp311-*.whl"))
        if found:
            return found[-1]
    return None


def stage_wheel() -> str | None:
    """Put the local CPU torch wheel in wheels/ (the build context), hard-linked where possible."""
    wheel = torch_wheel()
    if wheel is None:
        return "needs the local CPU torch wheel (torch-2.13.0+cpu-cp311) in /opt/wheels for an offline build"
    dest = REPO / "wheels" / wheel.name
    dest.parent.mkdir(exist_ok=True)
    if not dest.exists() or dest.stat().st_size != wheel.stat().st_size:
        dest.unlink(missing_ok=True)
        try:
            os.link(wheel, dest)
        except OSError:
            shutil.copy2(wheel, dest)
    return None


def build_train_image(extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """`dtrain build --no-push` from the local base; returns (the src-<hash> tag, the CLI's output)."""
    p = subprocess.run(
        [*CLI, "build", "--no-push", "--base-image", BASE_TAG, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if k != "DOCKER_HOST"},
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"dtrain build failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-2000:]}")
    m = re.search(r"dtrain-train:(src-[0-9a-f]{12})", p.stdout)
    assert m, p.stdout[-2000:]
    return f"dtrain-train:{m.group(1)}", p.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
