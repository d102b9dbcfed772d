"""The cluster service's loop: look (Compute API, Slurm, login sessions), decide (dtrain.service.logic),
act (start/stop/delete through dtrain.control.gcp.instances, scontrol resume), record (the state file,
the runs' events.jsonl).

    cfg = ServiceConfig.load(Path("/etc/dtrain/service.json"))
    Service(cfg, gcp=connect(cfg.project, cfg.cluster), shell=LocalShell()).run(handle)

`shell` runs Slurm's commands on the master: locally where the service runs on it (LocalShell), over SSH
in tests that run the service beside a test bed (dtrain.control.ssh via SshShell).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from dtrain.control.events import Events, Handle
from dtrain.control.slurm.commands import expand_hostlist
from dtrain.service import logic
from dtrain.service.logic import Action, Note, QueuedJob, Seen, State, Vm

POLL_S = 10.0
COMMAND_TIMEOUT_S = 30.0
SSH_ATTEMPTS = 3
# Interactive SSH logins on the master: sshd's per-session process is titled "sshd: USER@pts/N"
# ("sshd-session: USER@pts/N" from OpenSSH 9.8).
# dtrain's own commands (jobs, logs, this service's checks over SSH in tests) have no terminal
# ("USER@notty") and are not a person at work. Only processes in this network namespace count (the test
# bed's hosts share one process table).
SESSIONS = (
    "me=$(readlink /proc/self/ns/net); n=0; "
    "for p in $(pgrep -f '^sshd(-session)?: [^ ]+@pts/' 2>/dev/null); do "
    'ns=$(readlink /proc/$p/ns/net 2>/dev/null || echo "$me"); [ "$ns" = "$me" ] && n=$((n+1)); '
    "done; echo $n"
)
SQUEUE = "squeue -h -o '%i|%T|%r|%N|%M'"  # id, state, reason, nodes, elapsed ([D-]HH:MM:SS)
STALL_CHECK_S = 60.0  # how often a long-running job's last metrics line is read again
SINFO = "sinfo -h -N -o '%N|%t'"


def parse_duration(text: str | int | float | None, default: str = "60m") -> float | None:
    """The `autostop` key in seconds (dtrain.control.gcp.spec.autostop_seconds, which `dtrain up` checked
    the table with); None: autostop off. ValueError for a value that is not one."""
    from dtrain.common.errors import UserError
    from dtrain.control.gcp.spec import autostop_seconds

    if text is None:
        text = default
    if isinstance(text, float):
        return text or None
    try:
        return autostop_seconds(text)
    except UserError:
        raise ValueError(f'autostop = {text!r}: expected a duration like "30m", "90s", "2h", or "off"') from None


@dataclasses.dataclass(kw_only=True)
class ServiceConfig:
    """What the service watches; `dtrain up` writes it to the master as JSON."""

    cluster: str
    project: str
    zone: str
    master: str  # instance names (= Slurm node names on dtrain's clusters)
    workers: list[str]
    autostop: str = "60m"
    autostop_action: str = "stop"
    capacity_wait: str = "2h"  # autostop fires anyway after a node has waited this long for Spot capacity
    stall_after: str = "30m"  # a running job whose metrics have not advanced this long is not activity
    workdir: str  # the Slurm login workdir: its jobs/ table names each job's run
    state_file: str  # where the CLI reads the state (`dtrain jobs`, `dtrain status`)
    poll_s: float = POLL_S

    def __post_init__(self) -> None:
        if self.autostop_action not in ("stop", "delete"):
            raise ValueError(f'autostop_action = {self.autostop_action!r}: expected "stop" or "delete"')
        parse_duration(self.autostop)
        parse_duration(self.capacity_wait)
        self.stall_after_s  # noqa: B018 - checked here, used each poll

    @property
    def stall_after_s(self) -> float:
        from dtrain.control.cluster import duration

        return duration(self.stall_after, "stall_after", "the service's config")

    @classmethod
    def load(cls, path: Path) -> ServiceConfig:
        d = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class Shell(Protocol):
    def __call__(self, command: str) -> subprocess.CompletedProcess: ...


class LocalShell:
    def __call__(self, command: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        return subprocess.run(
            ["sh", "-c", command], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env, check=False
        )


class SshShell:
    """The master's commands over SSH (a service run beside the cluster, as the tests do)."""

    def __init__(self, cluster: Any) -> None:
        from dtrain.control.ssh import SSH

        self.ssh, self.node = SSH(cluster), cluster.master

    def __call__(self, command: str) -> subprocess.CompletedProcess:
        """Tried again when the SSH connection itself failed (a shared connection closing as another dtrain
        command ends); every command the service runs may run twice."""
        from dtrain.control.ssh import NodeError

        error = ""
        for attempt in range(SSH_ATTEMPTS):
            try:
                p = self.ssh.run(self.node, command, timeout=COMMAND_TIMEOUT_S, check=False)
                return subprocess.CompletedProcess(command, p.returncode, p.stdout.decode(), p.stderr.decode())
            except NodeError as e:
                error = str(e)
                time.sleep(0.5 * (attempt + 1))
        return subprocess.CompletedProcess(command, 255, "", error)

    def close(self) -> None:
        self.ssh.close()


class Service:
    def __init__(self, cfg: ServiceConfig, *, gcp: Any, shell: Shell, events: Events | None = None) -> None:
        self.cfg, self.gcp, self.shell = cfg, gcp, shell
        self.events = events or Events()
        self.state = self._load_state()
        self._urls: dict[str, str] = {}  # job id -> its run's URL (the job table's entry)
        self._stall_checked: dict[str, tuple[float, dict[str, Any]]] = {}  # job -> (when read, last metrics line)

    def _load_state(self) -> State:
        fresh = State(
            cluster=self.cfg.cluster,
            zone=self.cfg.zone,
            master=self.cfg.master,
            workers=list(self.cfg.workers),
            autostop_s=parse_duration(self.cfg.autostop),
            autostop_action=self.cfg.autostop_action,
            capacity_wait_s=parse_duration(self.cfg.capacity_wait),
        )
        with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
            old = State.from_dict(json.loads(Path(self.cfg.state_file).read_text()))
            fresh.nodes = old.nodes  # restarts and recoveries under way survive the service's restart
        return fresh

    # -- look ---------------------------------------------------------------------------------------

    def look(self, now: float | None = None) -> Seen:
        from dtrain.control.gcp.vmstates import node_states

        names = [self.cfg.master, *self.cfg.workers]
        vms: dict[str, Vm] | None
        error = ""
        try:
            vms = {
                s.name: Vm(s.name, s.status, s.preempted, s.preempted_at)
                for s in node_states(self.gcp, self.cfg.zone, self.cfg.cluster, expected=names)
            }
        except Exception as e:  # noqa: BLE001 - any failure is "no answer", never "not running"
            vms, error = None, " ".join(str(e).split())[:300]
        jobs = self._jobs(time.time() if now is None else now)
        return Seen(vms=vms, vm_error=error, jobs=jobs, slurm_up=self._slurm_up(), sessions=self._sessions())

    def _jobs(self, now: float) -> tuple[QueuedJob, ...] | None:
        p = self.shell(SQUEUE)
        if p.returncode != 0:
            return None
        jobs = []
        for line in p.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) in (4, 5):
                nodes = tuple(expand_hostlist(parts[3])) if parts[3] and parts[3] != "(null)" else ()
                elapsed = parts[4] if len(parts) == 5 else ""
                stalled = parts[1] == "RUNNING" and self._stalled(parts[0], elapsed, now)
                jobs.append(QueuedJob(parts[0], parts[1], parts[2], nodes, stalled=stalled))
        return tuple(jobs)

    def _stalled(self, job: str, elapsed: str, now: float) -> bool:
        """Whether a running job's run has logged no metrics line for stall_after (the rule `dtrain jobs`
        shows: dtrain.control.slurm.joblist.stall_since). Its last line is read only once the job has run that
        long, and then at most every STALL_CHECK_S; a run that cannot be read is not called stalled."""
        from dtrain.control.slurm.commands import JobState
        from dtrain.control.slurm.joblist import elapsed_seconds, stall_since

        stall_after = self.cfg.stall_after_s
        if not elapsed or elapsed_seconds(elapsed) < stall_after:
            return False
        checked = self._stall_checked.get(job)
        if checked is None or now - checked[0] >= STALL_CHECK_S:
            last = self._last_metrics(job)
            if last is None:
                return False
            checked = self._stall_checked[job] = (now, last)
        state = JobState(job_id=job, name="", state="RUNNING", elapsed=elapsed)
        return stall_since(state, checked[1], stall_after=stall_after, now=now) is not None

    def _last_metrics(self, job: str) -> dict[str, Any] | None:
        """The job's run's last metrics.jsonl line ({} before its first), None if its run is not known."""
        from dtrain.common.storage import is_remote, open_store
        from dtrain.control.slurm.joblist import last_line

        if job not in self._urls:
            self._urls.update(self._run_urls((job,)))
        url = self._urls.get(job)
        if url is None:
            return None
        try:
            if is_remote(url):
                return last_line(open_store(url).read_bytes("metrics.jsonl").decode())
            p = self.shell(f"tail -n 1 {shlex.quote(url + '/metrics.jsonl')} 2>/dev/null")
            return last_line(p.stdout)
        except Exception:  # noqa: BLE001 - unreadable is unknown, never "stalled"
            return None

    def _slurm_up(self) -> frozenset[str] | None:
        """Nodes whose slurmd answers (sinfo marks the others with "*"), whatever their state (a DOWN node
        that answers is what `scontrol update state=resume` returns)."""
        p = self.shell(SINFO)
        if p.returncode != 0:
            return None
        up = set()
        for line in p.stdout.splitlines():
            name, _, st = line.strip().partition("|")
            if name and st and "*" not in st:
                up.add(name)
        return frozenset(up)

    def _sessions(self) -> int | None:
        p = self.shell(SESSIONS)
        try:
            return int(p.stdout.strip()) if p.returncode == 0 else None
        except ValueError:
            return None

    # -- act ----------------------------------------------------------------------------------------

    def step(self, now: float | None = None) -> list[Action]:
        """One poll: look, decide, act, record. The actions taken."""
        now = time.time() if now is None else now
        seen = self.look(now)
        actions, notes = logic.decide(self.state, seen, now)
        for note in notes:
            self._record(note)
        for action in actions:
            self._act(action, now)
        self._write_state()
        return actions

    def _act(self, action: Action, now: float) -> None:
        """Do one action and record its outcome at the poll's time `now` (one clock per poll: the outcome's
        times are compared with the next polls' `now`)."""
        from dtrain.control.gcp import instances

        name, zone = action.node, self.cfg.zone
        if action.kind == "start":
            try:
                instances.start(self.gcp, zone, name)
            except instances.NoCapacity as e:
                note = logic.start_failed(self.state, name, now, str(e), no_capacity=True)
            except Exception as e:  # noqa: BLE001 - recorded, tried again after the backoff
                note = logic.start_failed(self.state, name, now, instances.describe(self.gcp, e), no_capacity=False)
            else:
                note = logic.started(self.state, name, now)
            if note:
                self._record(note)
        elif action.kind == "resume":
            command = f"scontrol update nodename={shlex.quote(name)} state=resume"
            if os.geteuid() != 0 and isinstance(self.shell, LocalShell):
                command = f"sudo -n {command}"
            p = self.shell(command)
            err = (p.stderr or "").strip()
            # "Invalid node state specified": it is already back (ReturnToService=2 returns it at registration).
            if p.returncode == 0 or "Invalid node state" in err:
                self._record(logic.resumed(self.state, name, now))
            else:
                self.events.warning(f"scontrol resume {name}: {err}")
        elif action.kind in ("stop", "delete"):
            why = self.state.stop_reason or f"idle since {logic.hhmm(self.state.idle_since or now)}"
            self._record(Note("autostop", name, f"autostop: {action.kind} {name} ({why})"))
            if name == self.cfg.master:
                self.state.stopped = True
                self._write_state()  # before the last call: this machine stops under us
            try:
                getattr(instances, action.kind)(self.gcp, zone, name)
            except Exception as e:  # noqa: BLE001
                self.events.warning(f"autostop: {action.kind} {name}: {instances.describe(self.gcp, e)}")

    # -- record -------------------------------------------------------------------------------------

    def _record(self, note: Note) -> None:
        """The service's log, and each affected run's events.jsonl (the runs' own events format)."""
        self.events.emit(note.kind, note.message, node=note.node, jobs=list(note.jobs))
        if not note.jobs:
            return
        from dtrain.common.metrics import record_event
        from dtrain.common.storage import open_store

        missing = tuple(j for j in note.jobs if j not in self._urls)
        if missing:
            self._urls.update(self._run_urls(missing))
        for job in note.jobs:
            url = self._urls.get(job)
            if url is None:
                self.events.warning(f"{note.kind} {note.node}: job {job}'s run not found: not recorded in its events")
                continue
            with contextlib.suppress(Exception):
                record_event(open_store(url), None, note.kind, note.message, node=note.node, job=job,
                             source="dtrain-service")  # fmt: skip

    def _run_urls(self, jobs: tuple[str, ...]) -> dict[str, str]:
        from dtrain.control.slurm.session import JOBS_DIR

        paths = " ".join(shlex.quote(f"{self.cfg.workdir}/{JOBS_DIR}/{j}.json") for j in jobs)
        p = self.shell(f'for f in {paths}; do cat "$f" 2>/dev/null; echo; done')
        out: dict[str, str] = {}
        for line in p.stdout.splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(line)
                out[str(rec["job_id"])] = rec["url"]
        return out

    def _write_state(self) -> None:
        path = Path(self.cfg.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.state.as_dict()
        data["lines"] = logic.describe(self.state, time.time())
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

    # -- run ----------------------------------------------------------------------------------------

    def run(self, handle: Handle | None = None, *, max_polls: int | None = None) -> None:
        """Poll until asked to stop, or until autostop has stopped the master (this machine)."""
        handle = handle or Handle()
        polls = 0
        while not handle.stopped and not self.state.stopped:
            started = time.monotonic()
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - one bad poll must not end the service
                self.events.warning(f"poll failed: {type(e).__name__}: {e}")
            polls += 1
            if max_polls is not None and polls >= max_polls:
                return
            end = started + self.cfg.poll_s
            while time.monotonic() < end and not handle.stopped:
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
