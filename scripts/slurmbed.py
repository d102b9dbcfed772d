"""A test bed for Slurm: scripts/testbed.py's hosts, made to look like separate machines that have Debian's
slurm-wlm and munge installed (each host under its own hostname, with its own /etc/slurm, /etc/munge,
/run/munge, /var/lib/slurm, ... and its own random munge key, as the package's install leaves it), and
no Slurm configured. dtrain configures it (`dtrain slurm setup` on a hosts cluster with `slurm = true`).

    with SlurmBed.create(3, Path("/tmp/sbed")) as sb:      # h0, h1, h2
        sb.hosts_toml("bed", sys.executable, nodes=2)     # [clusters.bed]: h0 and h1, slurm = true
        ...  dtrain slurm setup --cluster bed ...
        sb.make_login(sb.host("h2"), sb.host("h0"))       # h2: a login node (client config and key only)
        sb.slurm_toml("user", sys.executable, login=sb.host("h2"), workdir=sb.shared)  # backend = "slurm"
        sb.crash(sb.host("h1")); sb.revive(sb.host("h1"))  # every process killed; then "rebooted"

`revive` starts the host's sshd again and then what a machine's init would start from the Slurm and munge
files found there (munged; slurmd if slurm.conf names the host as a node; slurmctld if as the controller),
as systemd does with the units dtrain enables on VMs. Daemons started over SSH live in the host's
namespace and die with it at teardown. `shared` is a directory every host sees (the bed's root is on the
machine's filesystem), as a Slurm cluster's /home is.

From a shell (needs root):

    python scripts/slurmbed.py up --hosts 3 --dir /tmp/sbed    # prints dtrain.toml tables; Ctrl-C tears down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed import Host, Testbed  # noqa: E402

# What slurm-wlm and munge write outside /usr: each host gets its own (scripts/testbed.py's `private`).
PRIVATE = ("/etc/slurm", "/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge", "/var/lib/slurm",
           "/var/log/slurm", "/var/spool/slurmd")  # fmt: skip
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
# Hidden on a host by `hide_slurm`: a machine without Slurm's client commands.
CLIENT_COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sacct", "sinfo", "srun", "salloc")

BOOT = r"""
export PATH="$PATH:/usr/sbin:/sbin"
if [ -s /etc/munge/munge.key ]; then
  install -d -o munge -g munge -m 0755 /run/munge && runuser -u munge -- munged
fi
if [ -f /etc/slurm/slurm.conf ]; then
  if grep -q "^SlurmctldHost=$(hostname)(" /etc/slurm/slurm.conf; then slurmctld; fi
  if grep -q "^NodeName=$(hostname) " /etc/slurm/slurm.conf; then slurmd -N "$(hostname)"; fi
fi
"""


class SlurmBed:
    """A Testbed whose hosts are machines with Slurm's packages installed and nothing configured."""

    def __init__(self, bed: Testbed) -> None:
        self.bed = bed
        self.hosts = bed.hosts
        self.root = bed.root
        self.shared = bed.root / "shared"
        self.shared.mkdir(exist_ok=True)
        self.known_hosts = bed.write_known_hosts(bed.root / "known_hosts")

    @staticmethod
    def available() -> str | None:
        """None when a Slurm bed can be made here, else why not (to skip with)."""
        if reason := Testbed.available():
            return reason
        for p in PROGRAMS:
            if not shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
                return f"needs {p} (scripts/setup.sh installs slurm-wlm and munge)"
        return None

    @classmethod
    def create(cls, n: int, root: Path) -> SlurmBed:
        bed = Testbed.create(n, root, hostnames=True, private=PRIVATE)
        try:
            sb = cls(bed)
            for h in sb.hosts:
                sb._fresh_key(h)
            return sb
        except BaseException:
            bed.destroy()
            raise

    def _fresh_key(self, host: Host) -> None:
        """A random munge key, as the munge package's install makes one on each machine."""
        key = self.private(host, "/etc/munge/munge.key")
        key.write_bytes(secrets.token_bytes(1024))
        st = Path("/etc/munge").stat()
        os.chown(key, st.st_uid, st.st_gid)
        key.chmod(0o400)

    def private(self, host: Host, path: str) -> Path:
        """Where `path` of `host` (one of PRIVATE or under it) is on this machine's filesystem."""
        return host.dir / "fs" / path.lstrip("/")

    def host(self, name: str) -> Host:
        return self.bed.host(name)

    def ssh(self, host: Host, command: str, *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a shell command on `host` as root, over SSH (so in its namespaces)."""
        argv = ["ssh", "-i", str(self.bed.key), "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{host.address}", command]  # fmt: skip
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise RuntimeError(f"{host.name}: {command!r} exited {p.returncode}: {p.stderr.strip()[-500:]}")
        return p

    # -- dtrain.toml ------------------------------------------------------------------------------------

    def hosts_toml(self, name: str, python: str, *, nodes: int = 0, first: int = 0, slurm: bool = True,
                   env: dict[str, str] | None = None, workdir: str = "/var/lib/slurm/dtrain") -> str:  # fmt: skip
        """[clusters.NAME] of `nodes` hosts (default: all) from h<first>, backend hosts with slurm = true (or
        without Slurm). Every node gets the same workdir (Slurm's rule), on its own disk (its /var/lib/slurm)."""
        chosen = self.hosts[first : first + nodes] if nodes else self.hosts[first:]
        q = json.dumps
        lines = [f"[clusters.{name}]", 'backend = "hosts"', f"slurm = {str(slurm).lower()}", 'user = "root"',
                 f"key = {q(str(self.bed.key))}", f"python = {q(python)}",
                 f"known_hosts = {q(str(self.known_hosts))}", f"workdir = {q(workdir)}",
                 "shared_fs = true"]  # fmt: skip
        if env:
            lines += ["", f"[clusters.{name}.env]", *(f"{k} = {q(v)}" for k, v in env.items())]
        for i, h in enumerate(chosen):
            lines += ["", f"[[clusters.{name}.nodes]]", f"name = {q(h.name)}", f"address = {q(h.address)}"]
            lines += ["master = true"] if i == 0 else []
        return "\n".join(lines) + "\n"

    def slurm_toml(self, name: str, python: str, *, login: Host, workdir: Path, env: dict[str, str] | None = None,
                   extra: str = "") -> str:  # fmt: skip
        """[clusters.NAME] with backend = "slurm", reached at `login` as a user of an existing cluster would."""
        q = json.dumps
        lines = [f"[clusters.{name}]", 'backend = "slurm"',
                 f'login = {{ host = {q(login.address)}, user = "root", key = {q(str(self.bed.key))} }}',
                 f"python = {q(python)}", f"workdir = {q(str(workdir))}", f"known_hosts = {q(str(self.known_hosts))}",
                 "shared_fs = true", *([extra] if extra else [])]  # fmt: skip
        if env:
            lines += ["", f"[clusters.{name}.env]", *(f"{k} = {q(v)}" for k, v in env.items())]
        return "\n".join(lines) + "\n"

    # -- the cluster's administrators' work ---------------------------------------------------------------

    def make_login(self, login: Host, configured: Host) -> None:
        """Make `login` a login node of the Slurm that `configured` is part of: its slurm.conf and munge key,
        and munged running; no slurmd."""
        for path in ("/etc/slurm/slurm.conf", "/etc/munge/munge.key"):
            src, dst = self.private(configured, path), self.private(login, path)
            dst.unlink(missing_ok=True)
            shutil.copy2(src, dst)
            st = src.stat()
            os.chown(dst, st.st_uid, st.st_gid)
        self.ssh(login, "install -d -o munge -g munge -m 0755 /run/munge && runuser -u munge -- /usr/sbin/munged")

    def hide_slurm(self, host: Host, hidden: bool = True) -> None:
        """Make Slurm's client commands disappear on `host` (an overlay with whiteouts over /usr/bin, in the
        host's own mount namespace): a machine where Slurm is not installed. hidden=False undoes it."""
        if not hidden:
            self.ssh(host, "umount -l /usr/bin")  # lazily: this very shell runs from it
            return
        whiteouts = host.dir / "no-slurm"
        whiteouts.mkdir(exist_ok=True)
        for c in CLIENT_COMMANDS:
            if not (whiteouts / c).exists():
                os.mknod(whiteouts / c, 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout: char device 0:0
        self.ssh(host, f"mount -t overlay overlay -o lowerdir={whiteouts}:/usr/bin /usr/bin")

    def crash(self, host: Host) -> None:
        """Every process of `host` killed at once: the machine died."""
        self.bed.crash(host)

    def revive(self, host: Host) -> None:
        """The machine is back: sshd, then the daemons its init would start (see BOOT)."""
        self.bed.revive(host)
        self.ssh(host, BOOT)

    def daemon_pid(self, host: Host, daemon: str) -> int:
        """The pid of `daemon` (munged, slurmctld, slurmd) on `host`, from its pid file."""
        pidfile = {"munged": "/run/munge/munged.pid", "slurmctld": "/var/lib/slurm/slurmctld/slurmctld.pid",
                   "slurmd": "/var/lib/slurm/slurmd/slurmd.pid"}[daemon]  # fmt: skip
        return int(self.private(host, pidfile).read_text().split()[0])

    def restart_slurmctld(self, host: Host) -> None:
        """Stop the controller (SIGTERM, as systemctl stop does) and start it again."""
        self.ssh(host, 'p=$(cat /var/lib/slurm/slurmctld/slurmctld.pid); kill "$p"; '
                       'while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; /usr/sbin/slurmctld')  # fmt: skip

    def destroy(self) -> None:
        self.bed.destroy()

    def __enter__(self) -> SlurmBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create a Slurm bed and keep it until Ctrl-C/SIGTERM")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--dir", type=Path, required=True, help="root dir (created; deleted at teardown)")
    up.add_argument("--python", default=sys.executable, help="interpreter with torch, for the cluster tables")
    args = parser.parse_args(argv)
    if reason := SlurmBed.available():
        print(f"cannot create a Slurm bed: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SlurmBed.create(args.hosts, args.dir) as sb:
        print(sb.hosts_toml("bed", args.python, nodes=max(1, args.hosts - 1)))
        print(f"# dtrain slurm setup --cluster bed; then a login node: SlurmBed.make_login(h{args.hosts - 1}, h0)")
        print(f"# shared directory (as /home on a Slurm cluster): {sb.shared}")
        print("press Ctrl-C to tear down", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
