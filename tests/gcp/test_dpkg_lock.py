"""The cluster service's install waits for the dpkg lock (service_setup.make_venv), as the startup script
does: on a new VM unattended-upgrades holds it for minutes after boot, and an apt-get that does not wait
fails at once, at the last step of `dtrain up`.

The stand-ins: `apt-get` on PATH honours a real lock the way apt does (it takes an flock on the lock file;
with -o DPkg::Lock::Timeout=N it waits up to N s for it, without it fails at once with apt's message), and
`python3` cannot make a venv until that apt-get has "installed" python3-venv. The test holds the lock with
flock(1) for HOLD_S and checks that the venv step waited for it and then succeeded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dtrain.control.gcp import service_setup

from .test_service_setup import cluster

HOLD_S = 2.0

FAKE_APT = r"""#!/bin/bash
# apt-get as far as its dpkg lock goes: -o DPkg::Lock::Timeout=N waits N s for the lock, else no wait.
wait=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o) case "$2" in DPkg::Lock::Timeout=*) wait="${2#*=}";; esac; shift 2;;
    install) shift; break;;
    *) shift;;
  esac
done
exec 9>"$FAKE_ROOT/lock-frontend"
if ! flock -w "$wait" 9; then
  echo "E: Could not get lock $FAKE_ROOT/lock-frontend. It is held by process 1234 (unattended-upgr)" >&2
  exit 100
fi
for pkg in "$@"; do case "$pkg" in -*) ;; *) touch "$FAKE_ROOT/installed-$pkg";; esac; done
"""

FAKE_PYTHON = r"""#!/bin/bash
# python3 without ensurepip until python3-venv is installed (Ubuntu's python3 as a new VM has it).
if [ "$1 $2" = "-m venv" ]; then
  [ -e "$FAKE_ROOT/installed-python3-venv" ] || { echo "ensurepip is not available" >&2; exit 1; }
  mkdir -p "$3/bin" && exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def stand_ins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("apt-get", FAKE_APT), ("python3", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_ROOT": str(tmp_path), "REAL_PYTHON": sys.executable}


def hold_lock(tmp_path: Path, seconds: float) -> subprocess.Popen:
    """unattended-upgrades, as far as the lock goes: flock(1) holds it for `seconds`."""
    holder = subprocess.Popen(["flock", str(tmp_path / "lock-frontend"), "sleep", str(seconds)])
    deadline = time.monotonic() + 5
    probe = ["flock", "-n", str(tmp_path / "lock-frontend"), "true"]
    while subprocess.run(probe, check=False).returncode == 0:  # until the holder has it
        assert time.monotonic() < deadline, "flock did not take the lock"
        time.sleep(0.02)
    return holder


def run_step(script: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    p = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    return p, time.monotonic() - start


def test_the_venv_step_waits_for_a_held_dpkg_lock(tmp_path: Path):
    env = stand_ins(tmp_path)
    venv = tmp_path / "venv"
    script = service_setup.make_venv(str(venv))
    assert f"DPkg::Lock::Timeout={service_setup.APT_LOCK_WAIT_S}" in script
    holder = hold_lock(tmp_path, HOLD_S)
    try:
        p, elapsed = run_step(script, env)
    finally:
        holder.wait(timeout=10)
    assert p.returncode == 0, p.stderr
    assert (venv / "bin").is_dir() and (tmp_path / "installed-python3-venv").exists()
    assert elapsed >= HOLD_S * 0.8, f"returned after {elapsed:.2f} s: it did not wait for the lock"


def test_without_the_wait_the_same_step_fails_at_once(tmp_path: Path):
    # The step as it was (a bare apt-get install): the stand-in refuses at once, as apt does.
    env = stand_ins(tmp_path)
    venv = tmp_path / "venv"
    script = service_setup.make_venv(str(venv)).replace(f"-o DPkg::Lock::Timeout={service_setup.APT_LOCK_WAIT_S} ", "")
    assert "Lock::Timeout" not in script
    holder = hold_lock(tmp_path, HOLD_S)
    try:
        p, elapsed = run_step(script, env)
    finally:
        holder.wait(timeout=10)
    assert p.returncode != 0 and not venv.exists()
    assert elapsed < HOLD_S, elapsed


def test_the_install_script_uses_the_waiting_step():
    rec = {"name": "demo", "project": "p-123456", "zone": "us-central1-a"}
    config = service_setup.service_config(cluster(), rec, "/home/dtrain/dtrain", "30m", "stop")
    files = service_setup.service_files(config)
    script = service_setup.install_script(files, "dtrain", "/home/dtrain/dtrain", "0123456789ab")
    assert service_setup.make_venv(f"{service_setup.ROOT}/venv") in script
    assert "apt-get install" not in script  # every apt-get in it waits for the lock
    assert subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True).returncode == 0


def test_the_startup_script_waits_for_the_lock_too():
    from tests.infra.hcl import STARTUP_SCRIPT

    lines = STARTUP_SCRIPT.read_text().splitlines()
    calls = [line.strip() for line in lines if line.strip().startswith("apt-get ")]  # the commands, not messages
    assert calls and all("DPkg::Lock::Timeout=" in line for line in calls), calls
