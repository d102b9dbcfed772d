"""infra/node-startup.sh: syntax, shellcheck, and real runs against stub commands.

The stubs stand in for the metadata server (curl), docker, the NVIDIA tools, systemd, apt and the
user database, so the script's decisions and its readiness report are checked without root or a VM.
PATH holds only the stubs and the few real tools the script uses, so nothing on this machine is
touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .hcl import STARTUP_SCRIPT

REAL_TOOLS = ["cat", "mkdir", "mktemp", "chmod", "mv", "rm", "grep", "tr", "cut", "sleep", "flock", "sed", "env", "cp"]
DOCKER_VERSION = "27.5.1"
RUN_TIMEOUT_S = 30

STUBS = {
    # GET instance/attributes/KEY from $FAKE/md/KEY; PUT guest-attributes/dtrain/KEY to $FAKE/guest/KEY.
    "curl": r"""
echo "curl $*" >>"$FAKE/calls"
method=GET data= url=
while [ $# -gt 0 ]; do
  case "$1" in
    -X) method=$2; shift ;;
    --data) data=$2; shift ;;
    http*) url=$1 ;;
  esac
  shift
done
key=${url##*/}
if [ "$method" = PUT ]; then mkdir -p "$FAKE/guest"; printf '%s' "$data" >"$FAKE/guest/$key"; exit 0; fi
[ -f "$FAKE/md/$key" ] && cat "$FAKE/md/$key" && exit 0
exit 22
""",
    "docker": r"""
echo "docker $*" >>"$FAKE/calls"
case "$1" in
  info) if [ "${2:-}" = --format ]; then cat "$FAKE/runtimes"; fi; exit 0 ;;
  version) echo "$FAKE_DOCKER_VERSION"; exit 0 ;;
esac
exit 0
""",
    "nvidia-smi": r"""
echo "nvidia-smi $*" >>"$FAKE/calls"
i=0; while [ "$i" -lt "$FAKE_GPUS" ]; do echo "$i"; i=$((i + 1)); done
""",
    "nvidia-ctk": r"""
echo "nvidia-ctk $*" >>"$FAKE/calls"
echo '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}' >"$FAKE/runtimes"
""",
    "nvidia-container-cli": 'echo "nvidia-container-cli $*" >>"$FAKE/calls"\n',
    "systemctl": 'echo "systemctl $*" >>"$FAKE/calls"\n',
    "apt-get": r"""
echo "apt-get $*" >>"$FAKE/calls"
[ "${FAKE_APT_RC:-0}" = 0 ] || exit "$FAKE_APT_RC"
case " $* " in *" docker.io "*) cp "$FAKE/docker.stub" "$FAKE/bin/docker" ;; esac
exit 0
""",
    "getent": r"""
case "$1" in
  passwd) grep "^$2:" "$FAKE/passwd" ;;
  group) grep "^$2:" "$FAKE/group" ;;
  *) exit 2 ;;
esac
""",
    "useradd": r"""
echo "useradd $*" >>"$FAKE/calls"
for u; do :; done
echo "$u:x:1000:1000::/home/$u:/bin/bash" >>"$FAKE/passwd"
""",
    "groupadd": 'echo "groupadd $*" >>"$FAKE/calls"\nfor g; do :; done\necho "$g:x:999:" >>"$FAKE/group"\n',
    "usermod": 'echo "usermod $*" >>"$FAKE/calls"\necho "$2 $3" >>"$FAKE/members"\n',
    "id": r"""
[ "$1" = -nG ] || exit 2
grep -q "^$2:" "$FAKE/passwd" || exit 1
groups="$2"
while read -r g u; do [ "$u" = "$2" ] && groups="$groups $g"; done <"$FAKE/members"
echo "$groups"
""",
}


def test_bash_syntax():
    r = subprocess.run(["bash", "-n", str(STARTUP_SCRIPT)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("needs shellcheck (apt-get install shellcheck)")
    r = subprocess.run([exe, "-x", str(STARTUP_SCRIPT)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


class Node:
    """A fake node for one or more runs of the startup script."""

    def __init__(self, root: Path, *, gpus_wanted: int, gpus_present: int, docker: bool = True, runtimes: str = ""):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        for tool in REAL_TOOLS:
            path = shutil.which(tool)
            if path is None:
                pytest.skip(f"needs {tool}")
            (self.bin / tool).symlink_to(path)
        for name, body in STUBS.items():
            if name == "docker" and not docker:
                self._write(root / "docker.stub", body)
                continue
            self._write(self.bin / name, body)
            if name == "docker":
                self._write(root / "docker.stub", body)
        (root / "md").mkdir()
        (root / "md" / "dtrain-ssh-user").write_text("dtrain")
        (root / "md" / "dtrain-gpus").write_text(str(gpus_wanted))
        (root / "md" / "dtrain-registry-host").write_text("us-central1-docker.pkg.dev")
        for name in ("passwd", "group", "members", "calls"):
            (root / name).write_text("")
        (root / "runtimes").write_text(runtimes or '{"runc":{"path":"runc"}}')
        (root / "boot_id").write_text("test-boot-id\n")
        self.env = {
            "PATH": str(self.bin),
            "FAKE": str(root),
            "FAKE_GPUS": str(gpus_present),
            "FAKE_DOCKER_VERSION": DOCKER_VERSION,
            "DTRAIN_METADATA_URL": "http://metadata.test/computeMetadata/v1",
            "DTRAIN_STATE_DIR": str(root / "state"),
            "DTRAIN_BOOT_ID_FILE": str(root / "boot_id"),
            "DTRAIN_GPU_WAIT_S": "0",
            "DTRAIN_DOCKER_WAIT_S": "0",
            "DTRAIN_POLL_S": "0",
            "DTRAIN_APT_UPDATE_WAIT_S": "0",
        }

    def _write(self, path: Path, body: str) -> None:
        path.write_text("#!" + shutil.which("bash") + "\n" + body.lstrip("\n"))
        path.chmod(0o755)

    def run(self, **env: str) -> subprocess.CompletedProcess:
        self.root.joinpath("calls").write_text("")
        return subprocess.run(
            [shutil.which("bash"), str(STARTUP_SCRIPT)],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )

    @property
    def calls(self) -> list[str]:
        return self.root.joinpath("calls").read_text().splitlines()

    def ready(self) -> dict:
        file_json = json.loads((self.root / "state" / "ready").read_text())
        guest_json = json.loads((self.root / "guest" / "ready").read_text())
        assert guest_json == file_json, "the guest attribute must carry the same report as the file"
        return file_json


NVIDIA_RUNTIMES = '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'


def test_gpu_node_ready(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=2, gpus_present=2, runtimes=NVIDIA_RUNTIMES)
    r = node.run()
    assert r.returncode == 0, r.stderr
    assert node.ready() == {"ok": True, "gpus": 2, "docker": DOCKER_VERSION, "boot_id": "test-boot-id"}
    assert "useradd --create-home --shell /bin/bash dtrain" in node.calls
    assert "usermod -aG docker dtrain" in node.calls
    assert not [c for c in node.calls if c.startswith(("apt-get", "nvidia-ctk"))], "nothing to install on a DLVM"


def test_gpu_node_registers_nvidia_runtime(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=1, gpus_present=1)  # docker knows no nvidia runtime yet
    r = node.run()
    assert r.returncode == 0, r.stderr
    assert "nvidia-ctk runtime configure --runtime=docker" in node.calls
    assert "systemctl restart docker.service" in node.calls
    assert node.ready()["ok"] is True


def test_gpu_count_mismatch_is_reported(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=2, gpus_present=1, runtimes=NVIDIA_RUNTIMES)
    r = node.run()
    assert r.returncode == 1
    ready = node.ready()
    assert ready["ok"] is False and "expected 2 GPU(s), nvidia-smi shows 1" in ready["error"], ready


def test_cpu_node_installs_docker(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=0, gpus_present=0, docker=False)
    r = node.run()
    assert r.returncode == 0, r.stderr
    assert any(c.startswith("apt-get") and "docker.io" in c for c in node.calls), node.calls
    assert not [c for c in node.calls if c.startswith("nvidia")], "a CPU node must not look for GPUs"
    assert node.ready() == {"ok": True, "gpus": 0, "docker": DOCKER_VERSION, "boot_id": "test-boot-id"}


def test_docker_install_failure_is_reported(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=0, gpus_present=0, docker=False)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ready").write_text('{"ok": true, "gpus": 0, "docker": "old"}\n')  # a previous boot's
    r = node.run(FAKE_APT_RC="100")
    assert r.returncode == 1
    assert node.ready() == {"ok": False, "error": "apt-get install docker.io failed", "boot_id": "test-boot-id"}


def test_second_run_changes_nothing(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=0, gpus_present=0, docker=False)
    assert node.run().returncode == 0
    r = node.run()
    assert r.returncode == 0, r.stderr
    changes = [c for c in node.calls if c.startswith(("apt-get", "useradd", "groupadd", "usermod"))]
    assert changes == [], f"a second boot should find everything in place: {changes}"
    assert node.ready()["ok"] is True


def test_bad_metadata_is_reported(tmp_path: Path):
    node = Node(tmp_path, gpus_wanted=0, gpus_present=0)
    (tmp_path / "md" / "dtrain-ssh-user").write_text("Root;rm")
    r = node.run()
    assert r.returncode == 1
    assert "not a valid user name" in node.ready()["error"]
    assert os.path.exists(tmp_path / "state" / "ready")


# --- apt-get update against a held lists lock, with the real apt-get -------------------------------
#
# DPkg::Lock::Timeout covers dpkg's locks, not the lists lock (/var/lib/apt/lists/lock) that `apt-get
# update` takes. apt takes its locks with fcntl(F_SETLK) (apt-pkg's GetLock), so the stand-in for
# apt-daily.service below holds the lock the same way (flock(1) would not block apt: on Linux flock and
# fcntl locks are independent). APT_CONFIG points the real apt-get at a scratch tree with no sources,
# so its update touches nothing on this machine and needs no network.

LISTS_HOLD_S = 3.0
APT_DIRS = (
    "state/lists/partial",
    "cache/archives/partial",
    "etc/apt.conf.d",
    "etc/preferences.d",
    "etc/sources.list.d",
)


def apt_tree(root: Path) -> dict[str, str]:
    if shutil.which("apt-get") is None:
        pytest.skip("needs apt-get (Debian or Ubuntu)")
    for d in APT_DIRS:
        (root / d).mkdir(parents=True)
    (root / "etc" / "sources.list").write_text("")
    (root / "status").write_text("")
    conf = root / "apt.conf"
    settings = {
        "Dir::State": root / "state",
        "Dir::State::Lists": root / "state" / "lists",
        "Dir::State::status": root / "status",
        "Dir::Cache": root / "cache",
        "Dir::Etc": root / "etc",
        "Dir::Etc::sourcelist": root / "etc" / "sources.list",
        "Dir::Etc::sourceparts": root / "etc" / "sources.list.d",
        "Dir::Etc::main": root / "etc" / "apt.conf",
        "Dir::Etc::parts": root / "etc" / "apt.conf.d",
        "Dir::Etc::preferences": root / "etc" / "preferences",
        "Dir::Etc::preferencesparts": root / "etc" / "preferences.d",
    }
    conf.write_text("".join(f'{k} "{v}";\n' for k, v in settings.items()))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "APT_CONFIG": str(conf)}


def hold_lists_lock(root: Path, seconds: float) -> subprocess.Popen:
    """apt-daily, as far as the lists lock goes: an fcntl write lock on state/lists/lock for `seconds`."""
    lock = root / "state" / "lists" / "lock"
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o640)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        f"time.sleep({seconds})\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def run_function(function: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """Source the startup script (its main runs only when executed) and call one of its functions."""
    script = f'source "{STARTUP_SCRIPT}" && {function}'
    start = time.monotonic()
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return r, time.monotonic() - start


def test_real_apt_update_fails_at_once_on_a_held_lists_lock(tmp_path: Path):
    # What the script did before: one update with DPkg::Lock::Timeout, which does not cover this lock.
    env = apt_tree(tmp_path)
    holder = hold_lists_lock(tmp_path, LISTS_HOLD_S)
    try:
        start = time.monotonic()
        r = subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-qq"],
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        elapsed = time.monotonic() - start
    finally:
        holder.wait(timeout=10)
    assert r.returncode != 0 and "Could not get lock" in r.stderr and "lists/lock" in r.stderr, r.stderr
    assert elapsed < LISTS_HOLD_S, elapsed


def test_apt_update_waits_for_a_held_lists_lock(tmp_path: Path):
    env = {**apt_tree(tmp_path), "DTRAIN_APT_UPDATE_WAIT_S": "20", "DTRAIN_APT_UPDATE_RETRY_S": "1"}
    holder = hold_lists_lock(tmp_path, LISTS_HOLD_S)
    try:
        r, elapsed = run_function("apt_update", env)
    finally:
        holder.wait(timeout=10)
    assert r.returncode == 0, r.stderr
    assert "retrying in 1s" in r.stderr, r.stderr
    assert elapsed >= LISTS_HOLD_S * 0.8, f"returned after {elapsed:.1f} s: it did not wait for the lock"


def test_apt_update_gives_up_after_its_bound(tmp_path: Path):
    env = {**apt_tree(tmp_path), "DTRAIN_APT_UPDATE_WAIT_S": "2", "DTRAIN_APT_UPDATE_RETRY_S": "1"}
    holder = hold_lists_lock(tmp_path, 15)
    try:
        r, elapsed = run_function("apt_update", env)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert r.returncode == 1 and "apt-get update still failed after 2s" in r.stderr, r.stderr
    assert 2 <= elapsed < 10, elapsed
