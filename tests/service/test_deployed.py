"""The cluster service as `dtrain up` deploys it (dtrain.control.gcp.service_setup), run as the unit runs it:
the unit's own ExecStart and Environment, in a process of its own, as the unprivileged user the unit names,
from the code archive the install script unpacks, in a venv holding only the service's requirements, with
the real sudoers rule and the real `sudo -n scontrol`. Google's side is the Compute fake (tests/gcp).

What cannot run here: systemd (ProtectSystem=, ReadWritePaths=, Restart=always itself). Its part is played
by the test: the processes are started, killed (a crash) and stopped (SIGTERM, what `systemctl stop` and
`restart` send) as systemd would, and the service must carry on from its state file after each."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp.compute_fake import ComputeWorld  # noqa: E402

from dtrain.control.cluster import Cluster, Node  # noqa: E402
from dtrain.control.gcp import service_setup  # noqa: E402

pytestmark = pytest.mark.slow  # a venv with the Google client libraries from PyPI: 10 to 30 s

USER = service_setup.USER
PROJECT, ZONE = "dtrain-test", "us-central1-a"
MASTER, WORKER = "demo-master", "demo-worker-0"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's default PATH
WAIT_S = 90.0


def _needs() -> str | None:
    if os.geteuid() != 0:
        return "needs root: useradd, runuser and a sudoers drop-in, as `dtrain up` installs them"
    for tool in ("sudo", "visudo", "runuser", "useradd", "scontrol"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool} (scripts/setup.sh --dev installs sudo and slurm-wlm)"
    if not Path("/usr/bin/python3").exists():
        return "needs Debian's python3 (the interpreter the service's venv is made from)"
    return None


@pytest.fixture(scope="module")
def deployed() -> Iterator[dict]:
    """The service's files as the install script lays them out, under one world-readable temporary root
    (pytest's own temporary directories are 0700: the service's user could not reach them)."""
    if reason := _needs():
        pytest.skip(reason)
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        # the install script's own command (service_setup.install_script)
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", USER], check=True)  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="dtrain-service-", dir="/tmp"))
    sudoers = Path(service_setup.SUDOERS_PATH)
    try:
        base.chmod(0o755)
        root, etc, work = base / "opt", base / "etc", base / "home" / "work"
        code = root / "code"
        code.mkdir(parents=True)
        subprocess.run(["tar", "-xzf", "-", "-C", str(code)], input=service_setup.service_archive(), check=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(root / "venv")], check=True)
        pip = subprocess.run([str(root / "venv" / "bin" / "pip"), "install", "-q", *service_setup.REQUIREMENTS],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert pip.returncode == 0, pip.stderr[-3000:]

        cluster = Cluster(name="demo", backend="gcp", nodes=(Node(MASTER, "10.0.0.2", user="dtrain", master=True),
                                                             Node(WORKER, "10.0.0.3")))  # fmt: skip
        rec = {"name": "demo", "project": PROJECT, "zone": ZONE}
        config = service_setup.service_config(cluster, rec, str(work), "off", "stop")
        config["poll_s"] = 0.5  # a poll every 10 s deployed; this test has no time for that
        files = service_setup.service_files(config)
        etc.mkdir()
        (etc / "service.json").write_text(json.dumps(config))
        unit = service_setup.UNIT.format(user=USER, root=root, config=etc / "service.json",
                                         state_dir=Path(config["state_file"]).parent)  # fmt: skip
        # the install script's steps for the rest: the sudoers rule checked by visudo, the state directory
        sudoers.parent.mkdir(exist_ok=True)
        sudoers.write_text(files[service_setup.SUDOERS_PATH])
        sudoers.chmod(0o440)
        subprocess.run(["visudo", "-cf", str(sudoers)], check=True, capture_output=True)
        (work / "jobs").mkdir(parents=True)
        subprocess.run(["install", "-d", "-o", USER, "-m", "0755", str(Path(config["state_file"]).parent)], check=True)
        # the job table the SSH user's `dtrain submit` writes, and job 7's run
        run = base / "runs" / "mnist-1"
        run.mkdir(parents=True)
        shutil.chown(run, USER)
        (work / "jobs" / "7.json").write_text(json.dumps({"job_id": "7", "url": str(run)}))
        # Slurm's squeue and sinfo answer what the test sets (no slurmctld here); scontrol is the real one
        # and is reached through sudo only
        stand_ins = base / "bin"
        stand_ins.mkdir()
        for tool in ("squeue", "sinfo"):
            answer = base / f"{tool}.out"
            answer.write_text("")
            (base / f"{tool}.users").write_text("")
            shutil.chown(base / f"{tool}.users", USER)
            (stand_ins / tool).write_text(f"#!/bin/sh\nid -un >> {base}/{tool}.users\ncat {answer}\n")
            (stand_ins / tool).chmod(0o755)
        yield {"base": base, "unit": unit, "config": config, "run": run, "stand_ins": stand_ins}
    finally:
        sudoers.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def unit_command(unit: str) -> tuple[str, list[str], dict[str, str]]:
    """The unit's User=, ExecStart= (split) and Environment= (dtrain's unit quotes nothing)."""
    keys: dict[str, str] = {}
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("User", "ExecStart", "Environment"):
            keys[key] = value
    env = dict(item.split("=", 1) for item in keys["Environment"].split())
    return keys["User"], keys["ExecStart"].split(), env


class Supervised:
    """One start of the unit's command, as systemd starts it: its own session (systemd's control group),
    the unit's user and environment, output kept (journald)."""

    def __init__(self, d: dict, endpoint: str, extra: list[str] | None = None, config: Path | None = None) -> None:
        self.unit = d["unit"]
        user, argv, env = unit_command(d["unit"])
        if config is not None:
            argv[argv.index("--config") + 1] = str(config)
        env |= {"PATH": f"{d['stand_ins']}:{SYSTEM_PATH}", "DTRAIN_GCP_COMPUTE_ENDPOINT": endpoint,
                "DTRAIN_GCP_API_ENDPOINT": endpoint, "LANG": "C.UTF-8"}  # fmt: skip
        cmd = ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv, *(extra or [])]
        self.log = d["base"] / f"journal-{time.monotonic_ns()}.log"
        self.log_file = open(self.log, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """To the service's Python process, the unit's main process (runuser, which plays no part under
        systemd, passes its exit status on)."""
        os.kill(python_pid(self), sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log_file.close()

    def until(self, what: str, ok) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ok():
            assert self.proc.poll() is None, (
                f"the service exited ({self.proc.returncode}) before {what}:\n{self.output}"
            )
            assert time.monotonic() < deadline, f"no {what} after {WAIT_S:.0f} s:\n{self.output}"
            time.sleep(0.2)


def python_pid(s: Supervised) -> int:
    """The service's Python process: runuser's child, the unit's ExecStart (`env -i` execs it)."""
    python = unit_command(s.unit)[1][0]
    out = subprocess.run(["pgrep", "-P", str(s.proc.pid), "-f", f"^{python} "], capture_output=True,
                         text=True).stdout.split()  # fmt: skip
    assert len(out) == 1, out
    return int(out[0])


def test_the_deployed_service_restarts_a_preempted_node_as_its_own_user_across_restarts(deployed: dict) -> None:
    d = deployed
    state_file = Path(d["config"]["state_file"])
    world = ComputeWorld(PROJECT)
    world.add_region("us-central1", [ZONE])
    labels = {"dtrain-cluster": "demo"}
    world.add_instance(ZONE, MASTER, labels=labels, internal_ip="10.0.0.2")
    world.add_instance(ZONE, WORKER, labels=labels, spot=True, internal_ip="10.0.0.3")
    (d["base"] / "squeue.out").write_text(f"7|RUNNING|None|{MASTER},{WORKER}|00:10:00\n")
    (d["base"] / "sinfo.out").write_text(f"{MASTER}|idle\n{WORKER}|alloc\n")
    uid = pwd.getpwnam(USER).pw_uid
    with world.serve() as server:
        first = Supervised(d, server.endpoint)
        first.until("a state file", state_file.exists)
        assert Path(f"/proc/{python_pid(first)}").stat().st_uid == uid and state_file.stat().st_uid == uid
        # its local shell ran Slurm's commands as the service's user
        assert set((d["base"] / "squeue.users").read_text().split()) == {USER}
        world.mark_preempted(ZONE, WORKER)
        (d["base"] / "squeue.out").write_text("7|PENDING|BeginTime||0:00\n")
        (d["base"] / "sinfo.out").write_text(f"{MASTER}|idle\n{WORKER}|down*\n")
        first.until("a restart of the preempted worker", lambda: world.instances[(ZONE, WORKER)]["status"] == "RUNNING")
        first.until("the restart in the state file", lambda: '"returning"' in state_file.read_text())
        first.signal(signal.SIGKILL)  # a crash: systemd's Restart=always starts it again
        assert first.wait(30) != 0

        # Started again, it carries on from the state file: the worker's slurmd answers now, so it is
        # returned to Slurm through the real sudo rule and the real scontrol (which has no slurmctld here:
        # its own error, not sudo's refusal, shows the rule let it run as root).
        (d["base"] / "sinfo.out").write_text(f"{MASTER}|idle\n{WORKER}|down\n")
        second = Supervised(d, server.endpoint)
        second.until("a resume attempt", lambda: f"scontrol resume {WORKER}:" in second.output)
        line = next(ln for ln in second.output.splitlines() if f"scontrol resume {WORKER}:" in ln)
        assert "scontrol:" in line and "sudo:" not in line and "password" not in line, second.output
        assert world.called("POST", r"/instances/[^/]+/start$") == 1  # not started twice across the restart
        second.signal(signal.SIGTERM)  # `systemctl stop`/`restart`
        assert second.wait(15) == 0, second.output

    state = json.loads(state_file.read_text())
    assert state["nodes"][WORKER]["restarts"] == 1, state
    events = [json.loads(ln) for ln in (d["run"] / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["node"]) for e in events][:2] == [("preempted", WORKER), ("restarted", WORKER)], events
    assert all(e["source"] == "dtrain-service" for e in events)

    # The rule is narrow: the service's user may resume a node, and nothing else as root.
    other = subprocess.run(["runuser", "-u", USER, "--", "sudo", "-n", "scontrol", "update", f"nodename={WORKER}",
                            "state=down", "reason=x"], capture_output=True, text=True)  # fmt: skip
    assert other.returncode != 0 and "sudo:" in other.stderr, other.stderr


def test_a_fatal_config_error_is_one_line_and_a_non_zero_exit(deployed: dict) -> None:
    d = deployed
    bad = d["base"] / "etc" / "bad.json"
    bad.write_text(json.dumps({**d["config"], "autostop_action": "pause"}))
    for config in (bad, d["base"] / "etc" / "missing.json"):
        p = Supervised(d, "http://127.0.0.1:9", config=config)
        assert p.wait(60) == 2, p.output
        assert p.output.count("\n") == 1 and p.output.startswith(f"dtrain-service: cannot start: {config}: "), p.output
    # ...which the unit does not restart every 10 s for ever: systemd's Restart=always skips that exit status.
    assert "RestartPreventExitStatus=2" in d["unit"].splitlines()
