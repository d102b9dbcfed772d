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
