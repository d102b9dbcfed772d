"""Slurm on dtrain's own clusters (gcp, and hosts with `slurm = true`): configured and started over SSH.

    setup(cluster, events=..., handle=...)   `dtrain slurm setup`, and `dtrain up` on gcp after the VMs are ready

1. every node is probed: Slurm's and munge's programs (Debian/Ubuntu's slurm-wlm and munge packages; the
   gcp startup script installs them), its hostname, `slurmd -C` (CPUs, sockets, cores, threads, memory),
   its GPUs, systemd or not, root or passwordless sudo;
2. the cluster's munge key is made on this machine (`~/.config/dtrain/clusters/NAME/munge.key`, 0600,
   1024 random bytes) and copied to every node over SSH (stdin), never through instance metadata, a
   command line, a log or the repository;
3. slurm.conf (from the probed nodes: one partition `dtrain` of every node, whole nodes per job),
   cgroup.conf and gres.conf (GPU nodes) are written to every node; the same files on every node;
4. munged runs on every node, slurmctld on the master, slurmd on every node (the master computes too):
   systemd units where there is systemd (enabled, so they come back after a reboot), else the daemons
   started directly. A daemon is restarted only when its files changed, so running again is cheap and
   a cluster that grew (`dtrain up` with more workers) is reconfigured in place; Slurm keeps queued and
   running jobs across restarts of its daemons;
5. it waits until every node has registered with slurmctld.

Slurm's ports (slurmctld 6817, slurmd 6818, srun's ephemeral ports) need only be open between the
cluster's nodes: infra/network.tf's cluster-internal rule; nothing opens them to the outside.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import time
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.cluster import Cluster, Node, config_dir
from dtrain.control.events import Events, Handle
from dtrain.control.slurm.commands import READY_STATES
from dtrain.control.slurm.script import tar_of
from dtrain.control.slurm.spec import MANAGED_PARTITION
from dtrain.control.ssh import SSH, NodeError

# Tuning (docs/decisions.md, "Slurm on dtrain's own clusters"): a dead node is noticed in seconds.
SLURMD_TIMEOUT_S = 10  # no answer from a slurmd this long: its node is DOWN, its jobs requeued (default 300)
CRED_EXPIRE_S = 10  # a requeued job waits for its old credential to expire before it starts (default 120)
SCHED_INTERVAL_S = 5  # the main and backfill schedulers' passes (defaults 60 and 30 s)
KILL_WAIT_S = 60  # SIGTERM (scancel, time limit) to SIGKILL: ranks save a checkpoint in between (default 30)
READY_TIMEOUT_S = 90.0  # after (re)starting the daemons, every node must register within this
READY_POLL_S = 1.0
RESUME_AFTER_S = 15.0  # a node still down (from an earlier configuration) this long after the restart is resumed
KEY_BYTES = 1024
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun")
STATE_DIR = "/var/lib/slurm"  # Debian's and Ubuntu's
CTLD_PID = f"{STATE_DIR}/slurmctld/slurmctld.pid"
SLURMD_PID = f"{STATE_DIR}/slurmd/slurmd.pid"
MUNGE_PID = "/run/munge/munged.pid"
HARDWARE_KEYS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")

PROBE = r"""
export PATH="$PATH:/usr/sbin:/sbin"
for p in PROGRAMS; do command -v "$p" >/dev/null 2>&1 || echo "missing $p"; done
echo "hostname $(hostname -s)"
echo "hardware $(slurmd -C 2>/dev/null | head -n 1)"
echo "gpus $(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
[ -d /run/systemd/system ] && echo "systemd 1" || echo "systemd 0"
[ -f /sys/fs/cgroup/cgroup.controllers ] && echo "cgroup2 1" || echo "cgroup2 0"
echo "uid $(id -u)"
""".replace("PROGRAMS", " ".join(PROGRAMS))


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    node: Node
    hostname: str
    hardware: dict[str, str]  # slurmd -C's CPUs, Boards, ..., RealMemory
    gpus: int
    systemd: bool
    cgroup2: bool  # a unified (v2-only) cgroup hierarchy
    root: bool  # the SSH user is root (else commands go through sudo -n)
    missing: tuple[str, ...]

    @property
    def sudo(self) -> str:
        return "" if self.root else "sudo -n "


def probe(ssh: SSH, node: Node) -> NodeFacts:
    out = ssh.run(node, PROBE, timeout=60, check=False).stdout.decode(errors="replace")
    facts: dict[str, str] = {}
    missing = []
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "missing":
            missing.append(value)
        else:
            facts[key] = value.strip()
    hardware = dict(re.findall(r"(\w+)=(\S+)", facts.get("hardware", "")))
    return NodeFacts(
        node=node,
        hostname=facts.get("hostname") or node.name,
        hardware={k: hardware[k] for k in HARDWARE_KEYS if k in hardware},
        gpus=max(int(facts.get("gpus") or 0), node.gpus),
        systemd=facts.get("systemd") == "1",
        cgroup2=facts.get("cgroup2") == "1",
        root=facts.get("uid") == "0",
        missing=tuple(missing),
    )


def munge_key(cluster: str) -> bytes:
    """The cluster's munge key, made once on this machine and kept 0600 beside its other files."""
    path = config_dir() / "clusters" / cluster / "munge.key"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# the configuration files


def slurm_conf(cluster: Cluster, facts: list[NodeFacts]) -> str:
    """slurm.conf for the cluster: the master runs slurmctld, every node is a compute node in partition
    `dtrain`, jobs take whole nodes, and a dead node is noticed in seconds (see the constants above)."""
    master = facts[0]
    name = re.sub(r"[^a-z0-9_]", "_", cluster.name.lower())[:40] or "dtrain"
    lines = [
        f"# Written by dtrain (dtrain slurm setup / dtrain up) for cluster {cluster.name}: changes here are replaced.",
        f"ClusterName={name}",
        f"SlurmctldHost={master.hostname}({master.node.address})",
        "SlurmUser=slurm",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "# A requeued job starts again only once its previous credential expired (default 120 s).",
        f"AuthInfo=cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={STATE_DIR}/slurmctld",
        f"SlurmdSpoolDir={STATE_DIR}/slurmd",
        f"SlurmctldPidFile={CTLD_PID}",
        f"SlurmdPidFile={SLURMD_PID}",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "# A requeued job becomes eligible without an event to wake the scheduler: look every few seconds.",
        f"SchedulerParameters=sched_interval={SCHED_INTERVAL_S},bf_interval={SCHED_INTERVAL_S}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "# A node that stops answering is DOWN after SlurmdTimeout and its jobs are requeued; it rejoins by itself.",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        "ReturnToService=2",
        "JobRequeue=1",
        f"KillWait={KILL_WAIT_S}",
        "EnforcePartLimits=ALL",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "# Without slurmdbd, ended jobs are kept here (`sacct -c` on the master reads them).",
        "JobCompType=jobcomp/filetxt",
        "JobCompLoc=/var/log/slurm/jobcomp.log",
        "GresTypes=gpu",
    ]
    for f in facts:
        hw = " ".join(f"{k}={v}" for k, v in f.hardware.items())
        gres = f" Gres=gpu:{f.gpus}" if f.gpus else ""
        lines.append(
            f"NodeName={f.node.name} NodeHostname={f.hostname} NodeAddr={f.node.address} {hw}{gres} State=UNKNOWN"
        )
    nodes = ",".join(f.node.name for f in facts)
    lines.append(
        f"PartitionName={MANAGED_PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE"
    )
    return "\n".join(lines) + "\n"


def cgroup_conf(facts: list[NodeFacts]) -> str:
    """Processes are tracked by parentage (proctrack/linuxproc), not cgroups; slurmd still reads this file.
    On a hybrid (v1) hierarchy it must not try to mount or pick v2, or it exits at start."""
    if all(f.cgroup2 for f in facts):
        return "CgroupPlugin=autodetect\n"
    return "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


def gres_conf(facts: list[NodeFacts]) -> str:
    lines = [f"NodeName={f.node.name} Name=gpu File=/dev/nvidia[0-{f.gpus - 1}]" for f in facts if f.gpus]
    return "\n".join(lines) + "\n" if lines else ""


def systemd_overrides(node: Node) -> dict[str, str]:
    """Drop-ins for the packages' units: the pid files above, and slurmd under its Slurm node name."""
    return {
        "slurmctld.conf": f"[Service]\nPIDFile={CTLD_PID}\n",
        "slurmd.conf": (
            f"[Service]\nPIDFile={SLURMD_PID}\nExecStart=\nExecStart=/usr/sbin/slurmd -D -s -N {node.name}\n"
        ),
    }


# ---------------------------------------------------------------------------------------------
# installing and starting


INSTALL = r"""
set -e
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
tar -xf - -C "$t"
changed=""
put() {  # put FILE DEST MODE OWNER: install it unless the same file is there
  if ! cmp -s "$t/$1" "$2"; then install -m "$3" -o "${4%%:*}" -g "${4#*:}" "$t/$1" "$2"; changed="$changed $1"; fi
}
install -d -m 0700 -o munge -g munge /etc/munge
put munge.key /etc/munge/munge.key 0400 munge:munge
install -d -m 0755 /etc/slurm /var/log/slurm
chown slurm:slurm /var/log/slurm
install -d -m 0755 -o slurm -g slurm %(state)s/slurmctld
install -d -m 0755 %(state)s/slurmd
put slurm.conf /etc/slurm/slurm.conf 0644 root:root
put cgroup.conf /etc/slurm/cgroup.conf 0644 root:root
if [ -f "$t/gres.conf" ]; then put gres.conf /etc/slurm/gres.conf 0644 root:root; else rm -f /etc/slurm/gres.conf; fi
if [ -f "$t/slurmd.conf" ]; then
  install -d /etc/systemd/system/slurmd.service.d /etc/systemd/system/slurmctld.service.d
  put slurmd.conf /etc/systemd/system/slurmd.service.d/dtrain.conf 0644 root:root
  put slurmctld.conf /etc/systemd/system/slurmctld.service.d/dtrain.conf 0644 root:root
  systemctl daemon-reload
fi
echo "changed:$changed"
"""

# start DAEMON RESTART: (re)start one daemon; without systemd, by its pid file.
DAEMONS = r"""
set -e
export PATH="$PATH:/usr/sbin:/sbin"
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {
  if running "$1"; then
    kill "$(cat "$1")"; i=0
    while running "$1" && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
  fi
}
direct() {  # direct PIDFILE RESTART COMMAND...
  pidfile=$1; restart=$2; shift 2
  if [ "$restart" = 1 ] || ! running "$pidfile"; then stop "$pidfile"; "$@"; fi
}
unit() {  # unit NAME RESTART
  systemctl enable "$1" >/dev/null 2>&1
  if [ "$2" = 1 ]; then systemctl restart "$1"; else systemctl start "$1"; fi
}
"""


def _daemon(facts: NodeFacts, which: str, restart: bool) -> str:
    """The shell line that starts (or restarts) one daemon on a node."""
    r = "1" if restart else "0"
    if facts.systemd:
        unit = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd"}[which]
        return f"unit {unit} {r}"
    if which == "munged":
        return f"install -d -o munge -g munge -m 0755 /run/munge && direct {MUNGE_PID} {r} runuser -u munge -- munged"
    if which == "slurmctld":
        return f"direct {CTLD_PID} {r} slurmctld"
    return f"direct {SLURMD_PID} {r} slurmd -N {shlex.quote(facts.node.name)}"


def _as_root(facts: NodeFacts, script: str) -> str:
    return f"{facts.sudo}sh -c {shlex.quote(script)}"


@dataclasses.dataclass(frozen=True)
class SetupResult:
    cluster: str
    nodes: tuple[str, ...]
    changed: dict[str, tuple[str, ...]]  # node -> the files that were new or different there
    seconds: float


def setup(cluster: Cluster, *, events: Events, handle: Handle, accept_new_host_keys: bool = False) -> SetupResult:
    """Install the cluster's Slurm configuration and munge key on every node, start (or restart, where a file
    changed) munged, slurmctld and slurmd, and wait until every node has registered."""
    if cluster.slurm is None or not cluster.slurm.managed:
        raise UserError(
            f"cluster {cluster.name!r}: dtrain sets up Slurm on its own clusters only (gcp, or a hosts cluster "
            'with slurm = true); a cluster with backend = "slurm" has its own'
        )
    t0 = time.monotonic()
    with SSH(cluster, accept_new_host_keys=accept_new_host_keys) as ssh:
        ssh.connect_all()
        facts_by = ssh.each(lambda n: probe(ssh, n))
        facts = [facts_by[n.name] for n in cluster.nodes]
        for f in facts:
            if f.missing:
                raise NodeError(
                    f.node,
                    f"{', '.join(f.missing)} not found: install Slurm and munge there "
                    "(sudo apt-get install slurm-wlm munge), then run this again",
                )
            if not f.hardware:
                raise NodeError(f.node, "`slurmd -C` printed nothing: check the slurmd package there")
        events.info(
            f"Slurm on {len(facts)} node(s): slurmctld on {facts[0].node.name}, slurmd on "
            f"{', '.join(f.node.name for f in facts)} ({'systemd' if facts[0].systemd else 'no systemd'})"
        )
        key = munge_key(cluster.name)
        conf, cgroup, gres = slurm_conf(cluster, facts), cgroup_conf(facts), gres_conf(facts)

        def install(f: NodeFacts) -> tuple[str, ...]:
            files = {"munge.key": key, "slurm.conf": conf.encode(), "cgroup.conf": cgroup.encode()}
            if gres:
                files["gres.conf"] = gres.encode()
            if f.systemd:
                files.update({k: v.encode() for k, v in systemd_overrides(f.node).items()})
            p = ssh.run(
                f.node,
                _as_root(f, INSTALL % {"state": STATE_DIR}),
                input=tar_of({k: (v, 0o600) for k, v in files.items()}),
                timeout=120,
                check=False,
            )
            out = p.stdout.decode(errors="replace")
            if p.returncode != 0 or "changed:" not in out:
                raise _root_error(f, p.stderr.decode(errors="replace"), "installing the Slurm and munge files")
            return tuple(out.rsplit("changed:", 1)[1].split())

        changed = ssh.each(lambda n: install(facts_by[n.name]))
        for name, files in changed.items():
            if files:
                events.check(f"{name}: wrote {', '.join(files)}", True)
        slurm_files = {"slurm.conf", "cgroup.conf", "gres.conf", "slurmd.conf", "slurmctld.conf"}

        def start(f: NodeFacts, daemons: list[tuple[str, bool]]) -> None:
            script = DAEMONS + "\n".join(_daemon(f, which, restart) for which, restart in daemons)
            p = ssh.run(f.node, _as_root(f, script), timeout=120, check=False)
            if p.returncode != 0:
                raise _root_error(f, p.stderr.decode(errors="replace"), f"starting {', '.join(d for d, _ in daemons)}")

        ssh.each(lambda n: start(facts_by[n.name], [("munged", "munge.key" in changed[n.name])]))
        master = facts[0]
        any_conf = any(set(files) & slurm_files for files in changed.values())
        others = "systemctl disable --now slurmctld >/dev/null 2>&1 || true"  # the package enables it everywhere
        start(master, [("slurmctld", any_conf)])
        ssh.each(lambda n: start(facts_by[n.name], [("slurmd", any_conf or "munge.key" in changed[n.name])]))
        for f in facts[1:]:
            if f.systemd:
                ssh.run(f.node, _as_root(f, others), timeout=60, check=False)
        _wait_registered(ssh, master, [f.node.name for f in facts], events, handle)
    return SetupResult(
        cluster.name, tuple(n.name for n in cluster.nodes), {k: tuple(v) for k, v in changed.items()},
        time.monotonic() - t0,
    )  # fmt: skip


def _root_error(f: NodeFacts, stderr: str, doing: str) -> NodeError:
    err = " ".join(stderr.split())[-300:]
    if not f.root and ("password is required" in err or "sudo:" in err):
        return NodeError(
            f.node, f"{doing} needs root: log in as root, or give {f.node.user or 'the SSH user'} passwordless sudo"
        )
    return NodeError(f.node, f"{doing} failed: {err or 'no message'}")


def _wait_registered(ssh: SSH, master: NodeFacts, names: list[str], events: Events, handle: Handle) -> None:
    """Until sinfo shows every node up (idle, allocated, ...): slurmctld may take a moment to listen."""
    t0 = time.monotonic()
    resumed = False
    states: dict[str, str] = {}
    while True:
        p = ssh.run(master.node, f"sinfo -h -N -p {MANAGED_PARTITION} -o '%N|%t|%E'", timeout=60, check=False)
        rows = [ln.split("|", 2) for ln in p.stdout.decode(errors="replace").splitlines() if ln.count("|") == 2]
        states = {name: (state, reason) for name, state, reason in rows}  # type: ignore[misc]
        pending = [n for n in names if n not in states or states[n][0] not in READY_STATES]
        if p.returncode == 0 and not pending:
            events.check(f"Slurm: {len(names)} node(s) registered with slurmctld on {master.node.name}", True)
            return
        elapsed = time.monotonic() - t0
        if p.returncode == 0 and not resumed and elapsed > RESUME_AFTER_S:
            # Down or drained under an earlier configuration (Slurm keeps node states across restarts).
            down = ",".join(n for n in pending if n in states)
            if down:
                cmd = f"{master.sudo}scontrol update NodeName={down} State=RESUME"
                ssh.run(master.node, cmd, timeout=60, check=False)
            resumed = True
        if elapsed > READY_TIMEOUT_S or handle.stopped:
            detail = "; ".join(f"{n}: {' '.join(states.get(n, ('not listed', '')))}".strip() for n in pending)
            why = p.stderr.decode(errors="replace").strip()[-200:] if p.returncode else detail
            raise UserError(
                f"Slurm is not up on every node after {elapsed:.0f} s ({why}): see /var/log/slurm/ on those "
                "nodes, or `dtrain doctor`",
                exit_code=ExitCode.FAILURE,
            )
        time.sleep(READY_POLL_S)


# ---------------------------------------------------------------------------------------------
# doctor


def doctor_checks(ssh: SSH, cluster: Cluster, reachable: list[Node]) -> list[Any]:
    """`dtrain doctor`'s Slurm checks: munge on every node, with a credential made on the login node (the
    master) decoded everywhere (a node with another key fails here), slurmctld answering, every node's
    slurmd registered (dtrain's own clusters), the partition (a user's cluster)."""
    from dtrain.control.nodes import Check
    from dtrain.control.slurm.commands import Slurm

    assert cluster.slurm is not None
    login, checks = cluster.slurm.login, []
    if login not in reachable:
        return [Check(login.name, "slurm", False, "skipped: the login node does not answer SSH")]
    cred = ssh.run(login, "munge -n", timeout=30, check=False)
    if cred.returncode != 0:
        err = " ".join(cred.stderr.decode(errors="replace").split())[-200:]
        checks.append(Check(login.name, "munge", False, f"munge -n failed ({err})", _munge_fix(cluster)))
    else:
        for node in reachable:
            p = ssh.run(node, "unmunge", input=cred.stdout, timeout=30, check=False)
            ok = p.returncode == 0
            err = " ".join(p.stderr.decode(errors="replace").split())[-200:]
            detail = f"decodes {login.name}'s credential" if ok else f"cannot decode {login.name}'s credential ({err})"
            if not ok and "invalid credential" in err.lower():
                detail = f"its munge key differs from {login.name}'s ({err})"
            checks.append(Check(node.name, "munge", ok, detail, "" if ok else _munge_fix(cluster)))
    slurm = Slurm(ssh, login)
    try:
        ping = slurm.run("scontrol ping").strip()
        checks.append(Check(login.name, "slurmctld", " is UP" in ping, ping))
    except UserError as e:
        checks.append(Check(login.name, "slurmctld", False, str(e), "start slurmctld (dtrain slurm setup)"))
        return checks
    try:
        rows, default = slurm.nodes()
    except UserError as e:
        return [*checks, Check(login.name, "sinfo", False, str(e))]
    partition = cluster.slurm.partition or (MANAGED_PARTITION if cluster.slurm.managed else default)
    members = [n for n in rows if n.partition == partition]
    if not members:
        known = ", ".join(sorted({n.partition for n in rows})) or "none"
        fix = "set partition = ... to one of them" if not cluster.slurm.managed else _node_fix(cluster)
        checks.append(Check(login.name, "partition", False, f"no partition {partition!r} (partitions: {known})", fix))
    for n in members:
        detail = f"{n.state} in partition {partition}"
        checks.append(Check(n.name, "slurmd", n.up, detail, "" if n.up else _node_fix(cluster)))
    return checks


def _munge_fix(cluster: Cluster) -> str:
    if cluster.slurm is not None and cluster.slurm.managed:
        return f"run dtrain slurm setup --cluster {cluster.name} (it copies the cluster's key to every node)"
    return "ask the cluster's administrators: munged must run there with the cluster's key"


def _node_fix(cluster: Cluster) -> str:
    if cluster.slurm is not None and cluster.slurm.managed:
        return f"see /var/log/slurm/slurmd.log there; dtrain slurm setup --cluster {cluster.name} restarts it"
    return "a node Slurm marks down or drained: see sinfo -R"
