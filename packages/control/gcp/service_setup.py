"""The cluster service (dtrain.service) installed on a gcp cluster's master by `dtrain up`, over SSH as
Slurm's configuration is (dtrain.control.slurm.setup):

  - a system user `dtrain-service` runs it (never root); the only root command it may run is
    `scontrol update nodename=<node> state=resume` (a sudoers rule);
  - its code: dtrain's common, control and service packages under /opt/dtrain-service/code, with a venv
    holding the Google client libraries; credentials are the VM's service account (the metadata server);
  - its config: /etc/dtrain/service.json (ServiceConfig); its state: <workdir>/service/state.json, which
    `dtrain jobs`/`status` read;
  - a systemd unit, enabled (it comes back when the master starts again) and restarted when any of this
    changed.

The IAM side (what the service account may do) is infra/'s: iam.tf.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import shlex
import tarfile
from pathlib import Path
from typing import Any

from dtrain.control.cluster import Cluster
from dtrain.control.events import Events

USER = "dtrain-service"
ROOT = "/opt/dtrain-service"
CONFIG = "/etc/dtrain/service.json"
UNIT_PATH = "/etc/systemd/system/dtrain-service.service"
SUDOERS_PATH = "/etc/sudoers.d/dtrain-service"
PACKAGES = ("common", "control", "service")
APT_LOCK_WAIT_S = 600  # as infra/node-startup.sh's APT_LOCK_WAIT_S
REQUIREMENTS = ("google-cloud-compute>=1.19", "google-cloud-storage>=2.18", "google-auth>=2.30")

UNIT = """\
[Unit]
Description=dtrain cluster service: restarts preempted Spot nodes, stops the cluster when idle
After=network-online.target slurmctld.service
Wants=network-online.target

[Service]
User={user}
Environment=PYTHONPATH={root}/code PYTHONUNBUFFERED=1
ExecStart={root}/venv/bin/python -m dtrain.service --config {config}
Restart=always
RestartSec=10
# Exit 2 is a bad config (one line in the journal): restarting cannot fix it.
RestartPreventExitStatus=2
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths={state_dir}
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""

SUDOERS = "{user} ALL=(root) NOPASSWD: /usr/bin/scontrol update nodename=* state=resume\n"


def service_config(
    cluster: Cluster,
    rec: dict[str, Any],
    workdir: str,
    autostop: str,
    action: str,
    stall_after: str = "30m",
    capacity_wait: str = "2h",
) -> dict[str, Any]:
    """ServiceConfig's JSON for this cluster (instance names are Slurm's node names on dtrain's clusters)."""
    return {
        "cluster": rec["name"],
        "project": rec.get("project", ""),
        "zone": rec["zone"],
        "master": cluster.master.name,
        "workers": [n.name for n in cluster.nodes[1:]],
        "autostop": autostop,
        "autostop_action": action,
        "capacity_wait": capacity_wait,
        "stall_after": stall_after,
        "workdir": workdir,
        "state_file": f"{workdir}/service/state.json",
    }


def service_files(config: dict[str, Any]) -> dict[str, str]:
    state_dir = str(Path(config["state_file"]).parent)
    return {
        CONFIG: json.dumps(config, indent=1) + "\n",
        UNIT_PATH: UNIT.format(user=USER, root=ROOT, config=CONFIG, state_dir=state_dir),
        SUDOERS_PATH: SUDOERS.format(user=USER),
    }


def service_archive() -> bytes:
    """dtrain's packages the service imports, as a gzip'd tar (dtrain/<package>/...)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in PACKAGES:
            spec = importlib.util.find_spec(f"dtrain.{name}")
            assert spec is not None and spec.submodule_search_locations, name
            root = Path(list(spec.submodule_search_locations)[0])
            for f in sorted(root.rglob("*.py")):
                if "__pycache__" in f.parts:
                    continue
                ti = tarfile.TarInfo(f"dtrain/{name}/{f.relative_to(root).as_posix()}")
                data = f.read_bytes()
                ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def apt_install(*packages: str) -> str:
    """apt-get install that waits up to APT_LOCK_WAIT_S for the dpkg lock instead of failing at once: on a
    new VM unattended-upgrades holds it for minutes after boot (infra/node-startup.sh waits the same)."""
    return f"apt-get -o DPkg::Lock::Timeout={APT_LOCK_WAIT_S} install -y -q {shlex.join(packages)}"


def make_venv(path: str) -> str:
    """Shell that creates the venv at `path`; Ubuntu's python3 needs python3-venv (ensurepip) for that."""
    q = shlex.quote(path)
    return f"python3 -m venv {q} 2>/dev/null || {{ {apt_install('python3-venv')} >/dev/null && python3 -m venv {q}; }}"


def install_script(files: dict[str, str], ssh_user: str, workdir: str, digest: str) -> str:
    """The root shell script that installs or updates the service (the code archive on stdin)."""
    state_dir = str(Path(json.loads(files[CONFIG])["state_file"]).parent)
    writes = "\n".join(
        f"printf %s {shlex.quote(text)} > {shlex.quote(path)}.new && "
        f"if ! cmp -s {shlex.quote(path)}.new {shlex.quote(path)}; then mv {shlex.quote(path)}.new "
        f"{shlex.quote(path)}; changed=1; else rm {shlex.quote(path)}.new; fi"
        for path, text in files.items()
    )
    reqs = " ".join(shlex.quote(r) for r in REQUIREMENTS)
    q = shlex.quote
    return f"""set -e
changed=0
id {USER} >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {USER}
install -d -m 0755 {ROOT} /etc/dtrain
if [ "$(cat {ROOT}/code.digest 2>/dev/null)" != {q(digest)} ]; then
  rm -rf {ROOT}/code.new && mkdir {ROOT}/code.new && tar -xzf - -C {ROOT}/code.new
  rm -rf {ROOT}/code && mv {ROOT}/code.new {ROOT}/code && echo {q(digest)} > {ROOT}/code.digest; changed=1
else
  cat >/dev/null
fi
if [ ! -x {ROOT}/venv/bin/pip ]; then
  {make_venv(f"{ROOT}/venv")}
  {ROOT}/venv/bin/pip install -q {reqs}; changed=1
fi
{writes}
chmod 0440 {SUDOERS_PATH} && visudo -cf {SUDOERS_PATH} >/dev/null
# the service reads the job table and writes its state next to it: the SSH user's home must be traversable
chmod o+x ~{ssh_user} {q(workdir)} 2>/dev/null || true
install -d -o {USER} -m 0755 {q(state_dir)}
systemctl daemon-reload
systemctl enable dtrain-service >/dev/null 2>&1
if [ "$changed" = 1 ] || ! systemctl is-active -q dtrain-service; then systemctl restart dtrain-service; fi
"""


def install(ssh: Any, cluster: Cluster, rec: dict[str, Any], workdir: str, autostop: str, action: str,
            events: Events, stall_after: str = "30m", capacity_wait: str = "2h") -> None:  # fmt: skip
    """Install or update the service on the master over `ssh` (dtrain.control.ssh.SSH), as root (sudo)."""
    files = service_files(service_config(cluster, rec, workdir, autostop, action, stall_after, capacity_wait))
    archive = service_archive()
    digest = hashlib.sha256(archive).hexdigest()[:12]
    script = install_script(files, cluster.master.user or "root", workdir, digest)
    ssh.run(cluster.master, f"sudo -n sh -c {shlex.quote(script)}", input=archive, timeout=600)
    events.check(f"cluster service on {cluster.master.name} (autostop {autostop}, {action})", True)
