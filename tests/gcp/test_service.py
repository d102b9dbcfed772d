"""The cluster service (dtrain.service) against the Compute fake, with Slurm's answers scripted: it acts only
on a confirmed preemption, waits out a zone without capacity (and says so), returns the node to Slurm, records
the events in the run, and autostops workers first, the master last. Also `start_cluster` (what submit and up
do to a stopped cluster). The same service against a real Slurm: tests/slurm/test_service_bed.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dtrain.common.errors import UserError
from dtrain.control.events import Collector, Handle
from dtrain.control.gcp import instances
from dtrain.control.gcp.spec import autostop_seconds, gcp_spec
from dtrain.service import logic
from dtrain.service.daemon import Service, ServiceConfig, expand_hostlist, parse_duration

from .conftest import REGION

ZONE = f"{REGION}-a"
LABELS = {"dtrain-cluster": "demo"}
MASTER, WORKER = "demo-master", "demo-worker-0"


class FakeMaster:
    """The master's shell as the service uses it: Slurm's answers set by the test, the rest run here."""

    def __init__(self) -> None:
        self.squeue = ""
        self.sinfo = f"{MASTER}|idle\n{WORKER}|idle\n"
        self.sessions = 0
        self.commands: list[str] = []

    def __call__(self, command: str) -> subprocess.CompletedProcess:
        self.commands.append(command)
        if command.startswith("squeue"):
            return subprocess.CompletedProcess(command, 0, self.squeue, "")
        if command.startswith("sinfo"):
            return subprocess.CompletedProcess(command, 0, self.sinfo, "")
        if command.startswith("scontrol"):
            return subprocess.CompletedProcess(command, 0, "", "")
        if "pgrep" in command:
            return subprocess.CompletedProcess(command, 0, f"{self.sessions}\n", "")
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)


@pytest.fixture
def cluster(world, tmp_path: Path):
    world.polls_to_finish = 1
    world.add_instance(ZONE, MASTER, labels=LABELS, internal_ip="10.0.0.2")
    world.add_instance(ZONE, WORKER, labels=LABELS, spot=True, internal_ip="10.0.0.3")
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    run = tmp_path / "runs" / "mnist-1"
    run.mkdir(parents=True)
    (work / "jobs" / "7.json").write_text(json.dumps({"job_id": "7", "url": str(run)}))
    return work, run


def service(gcp, work: Path, master: FakeMaster, **kw) -> Service:
    state = str(work / "service" / "state.json")
    cfg = ServiceConfig(cluster="demo", project=gcp.project, zone=ZONE, master=MASTER, workers=[WORKER],
                        workdir=str(work), state_file=state, poll_s=0.01, **kw)  # fmt: skip
    return Service(cfg, gcp=gcp, shell=master, events=Collector())


def starts(world) -> int:
    return world.called("POST", r"/instances/[^/]+/start$")


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]


def test_a_failed_status_call_or_a_plain_stop_restarts_nothing(gcp, world, cluster):
    work, _ = cluster
    master = FakeMaster()
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}\n"
    svc = service(gcp, work, master)
    world.fail_status_once()
    assert svc.step() == []
    state = json.loads((work / "service" / "state.json").read_text())
    assert "Internal error" in state["status_error"]
    assert any("status calls failing since" in line for line in state["lines"]), state["lines"]
    world.instances[(ZONE, WORKER)]["status"] = "TERMINATED"  # stopped by someone: no preempted operation
    assert svc.step() == [] and svc.step() == []
    assert starts(world) == 0
    assert svc.state.status_error == ""


def test_a_preempted_worker_is_started_once_and_returned_to_slurm(gcp, world, cluster):
    work, run = cluster
    master = FakeMaster()
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}\n"
    svc = service(gcp, work, master)
    svc.step()  # sees job 7 on both nodes
    world.mark_preempted(ZONE, WORKER)
    master.squeue = "7|PENDING|BeginTime|\n"  # Slurm requeued it
    master.sinfo = f"{MASTER}|idle\n{WORKER}|down*\n"
    assert [a.kind for a in svc.step()] == ["start"]
    assert world.instances[(ZONE, WORKER)]["status"] == "RUNNING"
    assert svc.step() == []  # its slurmd does not answer yet
    master.sinfo = f"{MASTER}|idle\n{WORKER}|down\n"
    assert [a.kind for a in svc.step()] == ["resume"]
    assert any(c.startswith(f"scontrol update nodename={WORKER} state=resume") for c in master.commands)
    assert svc.step() == [] and starts(world) == 1
    assert svc.state.nodes[WORKER].restarts == 1
    rows = events(run)
    assert [(r["event"], r["node"], r["job"]) for r in rows] == [
        ("preempted", WORKER, "7"), ("restarted", WORKER, "7"), ("resumed", WORKER, "7")
    ]  # fmt: skip
    lines = json.loads((work / "service" / "state.json").read_text())["lines"]
    assert any(f"{WORKER}: 1 restart(s) after preemption" in line for line in lines), lines


def test_no_capacity_backs_off_and_says_since_when(gcp, world, cluster, monkeypatch):
    work, run = cluster
    monkeypatch.setattr(logic, "START_BACKOFF_S", 0.0)
    master = FakeMaster()
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}\n"
    svc = service(gcp, work, master)
    svc.step()
    world.mark_preempted(ZONE, WORKER)
    world.refuse_starts(3)
    seen_lines = []
    for _ in range(3):
        assert [a.kind for a in svc.step()] == ["start"]
        seen_lines += json.loads((work / "service" / "state.json").read_text())["lines"]
    waiting = [ln for ln in seen_lines if "waiting for capacity in us-central1-a since" in ln]
    assert len(waiting) == 3, seen_lines
    assert world.instances[(ZONE, WORKER)]["status"] == "TERMINATED"
    svc.step()
    assert starts(world) == 4 and world.instances[(ZONE, WORKER)]["status"] == "RUNNING"
    kinds = [r["event"] for r in events(run)]
    assert kinds == ["preempted", "waiting-capacity", "restarted"], kinds  # one note for the wait, not three


def test_backoff_grows_and_is_capped():
    assert [logic.backoff(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert logic.backoff(50) == logic.START_BACKOFF_CAP_S


def test_autostop_stops_workers_then_the_master(gcp, world, cluster):
    work, _ = cluster
    master = FakeMaster()
    svc = service(gcp, work, master, autostop="1s")
    master.squeue = "9|PENDING|Resources|\n"  # a job that can run keeps the cluster up
    svc.step(now=1000.0)
    svc.step(now=1010.0)
    assert svc.state.idle_since is None
    master.squeue, master.sessions = "", 1  # someone logged in
    svc.step(now=1020.0)
    assert svc.state.idle_since is None
    master.sessions = 0
    master.squeue = "9|PENDING|JobHeldUser|\n"  # held: never runs on its own (skypilot#9926)
    assert svc.step(now=1030.0) == []
    assert svc.state.idle_since == 1030.0
    actions = svc.step(now=1031.5)
    assert [(a.kind, a.node) for a in actions] == [("stop", WORKER), ("stop", MASTER)]
    stops = [p for m, p, _ in world.requests if m == "POST" and p.endswith("/stop")]
    assert [p.split("/")[-2] for p in stops] == [WORKER, MASTER]  # the master's stop is the last call
    assert {world.instances[(ZONE, n)]["status"] for n in (MASTER, WORKER)} == {"TERMINATED"}
    assert svc.state.stopped
    svc.run(Handle(), max_polls=5)  # ends at once: the machine it runs on is stopping
    assert len(stops) == len([p for m, p, _ in world.requests if m == "POST" and p.endswith("/stop")])


def test_a_stalled_job_does_not_keep_the_cluster_up(gcp, world, cluster):
    """A running job whose run has logged no metrics line for stall_after holds its nodes but does no work
    (skypilot#715, #10628): autostop stops the cluster under it. One whose metrics advance keeps it up."""
    work, run = cluster
    master = FakeMaster()
    svc = service(gcp, work, master, autostop="60s", stall_after="10m")
    t0 = 100_000.0
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "time": t0 - 30}) + "\n")
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}|01:00:00\n"  # an hour in; its last line 30 s ago
    assert svc.step(now=t0) == []
    assert svc.step(now=t0 + 30) == []  # read a minute ago at most: not read again
    assert svc.step(now=t0 + 61) == [] and svc.state.idle_since is None  # advancing: activity
    assert svc.step(now=t0 + 630) == []  # 660 s since its last line: stalled, so the idle clock starts
    assert svc.state.idle_since == t0 + 630
    actions = svc.step(now=t0 + 691)
    assert [(a.kind, a.node) for a in actions] == [("stop", WORKER), ("stop", MASTER)]
    assert sum("metrics.jsonl" in c for c in master.commands) == 4  # 5 polls: read at most once a minute


def test_a_job_whose_run_cannot_be_read_is_not_called_stalled(gcp, world, cluster):
    work, run = cluster
    master = FakeMaster()
    svc = service(gcp, work, master, autostop="1s", stall_after="1m")
    master.squeue = f"8|RUNNING|None|{MASTER}|01:00:00\n"  # job 8 is not in the job table
    svc.step(now=1000.0)
    svc.step(now=1100.0)
    assert svc.state.idle_since is None and not svc.state.stopping


def test_autostop_skips_a_worker_already_stopped(gcp, world, cluster):
    work, _ = cluster
    world.add_instance(ZONE, "demo-worker-1", labels=LABELS, status="TERMINATED", internal_ip="10.0.0.4")
    cfg_workers = [WORKER, "demo-worker-1"]
    svc = service(gcp, work, FakeMaster(), autostop="5s")
    svc.cfg.workers = svc.state.workers = cfg_workers
    svc.step(now=0.0)
    assert [(a.kind, a.node) for a in svc.step(now=5.0)] == [("stop", WORKER), ("stop", MASTER)]


def test_autostop_delete(gcp, world, cluster):
    work, _ = cluster
    svc = service(gcp, work, FakeMaster(), autostop="5s", autostop_action="delete")
    svc.step(now=0.0)
    assert [(a.kind, a.node) for a in svc.step(now=5.0)] == [("delete", WORKER), ("delete", MASTER)]
    assert not world.instances


def test_autostop_off_and_durations():
    assert parse_duration("30m") == 1800 and parse_duration("90s") == 90 and parse_duration("2h") == 7200
    assert parse_duration("off") is None and parse_duration("0") is None and parse_duration(None) == 3600
    with pytest.raises(ValueError, match="autostop = 'soon'"):
        parse_duration("soon")
    # The service reads the key as `dtrain up` checked it in the cluster table: one reading, one set of words.
    for text in ("30m", "1h30m", "90s", "off", "OFF", "0"):
        assert parse_duration(text) == autostop_seconds(text)
        assert gcp_spec("demo", {"backend": "gcp", "project": "my-project", "autostop": text}, "t").autostop == text
    for text in ("soon", "none", "90"):
        with pytest.raises(UserError, match=r"^t: autostop must be a duration"):
            gcp_spec("demo", {"backend": "gcp", "project": "my-project", "autostop": text}, "t")
        with pytest.raises(ValueError, match="expected a duration"):
            parse_duration(text)
    # The daemon reads host lists with the one function (dtrain.control.slurm.commands), suffixes and all.
    assert expand_hostlist("h[0-1,3],w-00") == ["h0", "h1", "h3", "w-00"]
    assert expand_hostlist("n[08-10]-ib") == ["n08-ib", "n09-ib", "n10-ib"]
    assert expand_hostlist("n[a-c],h1") == ["na-c", "h1"]  # not a number range: kept, never a crash


def test_start_cluster_starts_the_master_first_and_waits_for_capacity(gcp, world, cluster):
    for name in (MASTER, WORKER):
        world.instances[(ZONE, name)]["status"] = "TERMINATED"
    world.refuse_starts(2, name=WORKER)
    ev = Collector()
    r = instances.start_cluster(gcp, ZONE, "demo", [MASTER, WORKER], events=ev, handle=Handle(), backoff_s=0.0)
    assert r.started == (MASTER, WORKER)
    started = [p.split("/")[-2] for m, p, _ in world.requests if m == "POST" and p.endswith("/start")]
    assert started == [MASTER, WORKER, WORKER, WORKER]
    assert sum("waiting for capacity in us-central1-a" in e.message for e in ev.events) == 2
    again = instances.start_cluster(gcp, ZONE, "demo", [MASTER, WORKER], events=ev, handle=Handle())
    assert again.started == ()


def test_start_cluster_names_deleted_nodes(gcp, world, cluster):
    del world.instances[(ZONE, WORKER)]
    from dtrain.common.errors import UserError

    with pytest.raises(UserError, match="demo-worker-0 no longer exist.*dtrain up --cluster demo"):
        instances.start_cluster(gcp, ZONE, "demo", [MASTER, WORKER], events=Collector(), handle=Handle())


def test_ensure_running_starts_a_stopped_cluster_and_refreshes_its_addresses(
    gcp, world, cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """What `dtrain submit`/`up` do first on a gcp cluster: start what is stopped (the master first), take
    the new external IPs into the record, wait for the nodes; after autostop_action = "delete", `up` starts
    what is left and leaves the rest to Terraform."""
    from dtrain.control.gcp import lifecycle
    from dtrain.control.gcp.record import key_path, read_record, write_record
    from dtrain.control.settings import cluster_config

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for name in ("DTRAIN_GCP_COMPUTE_ENDPOINT", "DTRAIN_GCP_API_ENDPOINT"):
        monkeypatch.setenv(name, gcp.endpoint)
    nodes = [{"name": n, "role": r, "internal_ip": ip, "external_ip": "34.0.0.1", "gpus": 0}
             for n, r, ip in ((MASTER, "master", "10.0.0.2"), (WORKER, "worker", "10.0.0.3"))]  # fmt: skip
    write_record({"name": "demo", "project": gcp.project, "zone": ZONE, "bucket": "gs://b", "ssh_user": "dtrain",
                  "nodes": nodes})  # fmt: skip
    key_path("demo").write_text("key")
    toml = tmp_path / "dtrain.toml"
    toml.write_text(f'[clusters.demo]\nbackend = "gcp"\nproject = "{gcp.project}"\nzone = "{ZONE}"\n'
                    'ssh_source_ranges = ["203.0.113.7/32"]\n')  # fmt: skip
    cfg = cluster_config(toml, "demo")
    waited: list[list[str]] = []
    monkeypatch.setattr(lifecycle, "wait_ready", lambda c, **kw: waited.append([n.ssh_host for n in c.nodes]))
    assert lifecycle.ensure_running(cfg, events=Collector(), handle=Handle()) is False  # running: nothing to do
    for name, ip in ((MASTER, "35.0.0.2"), (WORKER, "35.0.0.3")):
        world.instances[(ZONE, name)]["status"] = "TERMINATED"
        world.instances[(ZONE, name)]["networkInterfaces"][0]["accessConfigs"] = [{"natIP": ip}]
    assert lifecycle.ensure_running(cfg, events=Collector(), handle=Handle()) is True
    assert [p.split("/")[-2] for m, p, _ in world.requests if p.endswith("/start")] == [MASTER, WORKER]
    assert waited == [["35.0.0.2", "35.0.0.3"]]
    assert [n["external_ip"] for n in read_record("demo")["nodes"]] == ["35.0.0.2", "35.0.0.3"]

    del world.instances[(ZONE, WORKER)]
    world.instances[(ZONE, MASTER)]["status"] = "TERMINATED"
    assert lifecycle.ensure_running(cfg, events=Collector(), handle=Handle(), missing_ok=True) is True
    assert world.instances[(ZONE, MASTER)]["status"] == "RUNNING" and len(waited) == 1


def test_a_spot_stockout_does_not_keep_the_cluster_up_for_ever(gcp, world, cluster):
    """A preempted worker that finds no capacity: its job waits (pending), and before this bound the
    on-demand master billed until capacity came back. After capacity_wait, autostop fires anyway, unless
    someone is logged in or a job runs; `dtrain status` says when, while it waits."""
    import time

    work, _ = cluster
    master = FakeMaster()
    svc = service(gcp, work, master, autostop="60s", capacity_wait="1h")
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}\n"
    svc.step()
    world.mark_preempted(ZONE, WORKER)
    world.refuse_starts(1000)  # a stockout
    master.squeue = "7|PENDING|BeginTime|\n"  # requeued: it can run once the worker is back
    t0 = time.time()
    assert [a.kind for a in svc.step(now=t0)] == ["start"]
    since = svc.state.nodes[WORKER].down_since
    assert since == t0 and abs(svc.state.nodes[WORKER].capacity_since - t0) < 5
    lines = json.loads((work / "service" / "state.json").read_text())["lines"]
    status = [ln for ln in lines if ln.startswith("autostop:")]
    assert status == [
        f"autostop: waiting for Spot capacity since {logic.hhmm(since)}, autostop in 60 min "
        f"(at {logic.hhmm(since + 3600)}) unless a job runs or capacity returns; stop then"
    ], lines
    # Half-way: still waiting (and still trying to start it); the pending job alone no longer counts.
    assert [a.kind for a in svc.step(now=since + 1800)] == ["start"] and not svc.state.stopping
    # Past the bound with someone logged in: kept up.
    master.sessions = 1
    assert [a.kind for a in svc.step(now=since + 3601)] == ["start"] and not svc.state.stopping
    master.sessions = 0
    # ...and with nobody: stopped, no new start; the worker is already TERMINATED, so only the master.
    actions = svc.step(now=since + 3602)
    assert [(a.kind, a.node) for a in actions] == [("stop", MASTER)]
    assert world.instances[(ZONE, MASTER)]["status"] == "TERMINATED" and svc.state.stopped
    reason = f"waiting for Spot capacity since {logic.hhmm(since)}"
    assert svc.state.stop_reason == reason
    assert any(e.kind == "autostop" and reason in e.message for e in svc.events.events), svc.events.events
    lines = json.loads((work / "service" / "state.json").read_text())["lines"]
    assert f"autostop: stop of every node done ({reason})" in lines, lines


def test_a_running_job_keeps_the_cluster_up_through_a_stockout():
    # The bound is for a cluster that can do nothing; a job still running on other nodes is work.
    state = logic.State(cluster="demo", zone=ZONE, master=MASTER, workers=[WORKER, "demo-worker-1"],
                        autostop_s=60.0, capacity_wait_s=3600.0)  # fmt: skip
    vms = {
        MASTER: logic.Vm(MASTER, "RUNNING", False),
        WORKER: logic.Vm(WORKER, "TERMINATED", True),
        "demo-worker-1": logic.Vm("demo-worker-1", "RUNNING", False),
    }
    t = state.track(WORKER)
    t.phase, t.capacity_since, t.next_try = "waiting-capacity", 1000.0, 1e12  # no start due in this test
    running = logic.QueuedJob("8", "RUNNING", "None", (MASTER, "demo-worker-1"))
    seen = logic.Seen(vms=vms, jobs=(running,), sessions=0)
    assert logic.decide(state, seen, 1000.0 + 7200)[0] == [] and not state.stopping
    # capacity_wait = "off": the old behaviour, wait for ever, and status says so.
    state.capacity_wait_s = None
    seen = logic.Seen(vms=vms, jobs=(logic.QueuedJob("7", "PENDING", "BeginTime", ()),), sessions=0)
    assert logic.decide(state, seen, 1000.0 + 86400)[0] == [] and not state.stopping
    assert any("no bound (capacity_wait = off)" in ln for ln in logic.describe(state, 1000.0 + 86400))


T0 = 100_000.0  # the polls' clock in the bound's tests (the service records its actions' outcomes on it)


def bounded_service(gcp, cluster) -> tuple[Service, FakeMaster]:
    """A service with autostop 60 s and capacity_wait 1 h that saw job 7 running on both nodes at T0 - 10;
    the job is pending now (requeued: it runs once the worker is back)."""
    work, _ = cluster
    master = FakeMaster()
    svc = service(gcp, work, master, autostop="60s", capacity_wait="1h")
    master.squeue = f"7|RUNNING|None|{MASTER},{WORKER}\n"
    svc.step(now=T0 - 10)
    master.squeue = "7|PENDING|BeginTime|\n"
    return svc, master


def test_a_start_refused_for_quota_does_not_keep_the_cluster_up_for_ever(gcp, world, cluster):
    """Issue 31, A.7: a preempted worker whose start is refused for a reason other than a stockout
    (QUOTA_EXCEEDED: another VM took the freed preemptible quota) is "start-failed", not
    "waiting-capacity"; before the fix only a stockout was bounded and this one held the on-demand master
    up for ever. The same capacity_wait bounds it."""
    svc, master = bounded_service(gcp, cluster)
    world.mark_preempted(ZONE, WORKER)
    world.refuse_starts(1000, code="QUOTA_EXCEEDED")
    assert [a.kind for a in svc.step(now=T0)] == ["start"]
    t = svc.state.nodes[WORKER]
    assert t.phase == "start-failed" and t.last_error.startswith("QUOTA_EXCEEDED: Quota 'PREEMPTIBLE_CPUS'")
    lines = logic.describe(svc.state, T0)
    assert (
        f"autostop: waiting for {WORKER} to come back since {logic.hhmm(T0)}, autostop in 60 min "
        f"(at {logic.hhmm(T0 + 3600)}) unless a job runs or they return; stop then"
    ) in lines, lines
    assert [a.kind for a in svc.step(now=T0 + 1800)] == ["start"] and not svc.state.stopping
    actions = svc.step(now=T0 + 3600)
    assert [(a.kind, a.node) for a in actions] == [("stop", MASTER)]
    assert svc.state.stop_reason == f"waiting for {WORKER} to come back since {logic.hhmm(T0)}"
    assert world.instances[(ZONE, MASTER)]["status"] == "TERMINATED"


def test_a_worker_preempted_soon_after_each_start_does_not_keep_the_cluster_up_for_ever(gcp, world, cluster):
    """Issue 31, A.7: each start succeeds and the worker is preempted again minutes later, before or just
    after it is back in Slurm. Before the fix every start reset the wait, so autostop never fired; now the
    wait runs from the first preemption until the node has stayed back for RECOVERED_S."""
    svc, master = bounded_service(gcp, cluster)
    now = T0
    for cycle in range(6):  # preempted every 10 minutes, 60 minutes in all
        world.mark_preempted(ZONE, WORKER)
        master.sinfo = f"{MASTER}|idle\n{WORKER}|down*\n"
        assert [a.kind for a in svc.step(now=now)] == ["start"], cycle
        assert world.instances[(ZONE, WORKER)]["status"] == "RUNNING"
        if cycle % 2:  # back in Slurm for a moment this time: still not back for RECOVERED_S
            master.sinfo = f"{MASTER}|idle\n{WORKER}|down\n"
            assert [a.kind for a in svc.step(now=now + 60)] == ["resume"]
            assert svc.state.nodes[WORKER].phase == "ok"
        assert svc.state.nodes[WORKER].down_since == T0 and not svc.state.stopping
        now += 600
    assert now == T0 + 3600 and svc.state.nodes[WORKER].restarts == 6
    world.mark_preempted(ZONE, WORKER)
    master.sinfo = f"{MASTER}|idle\n{WORKER}|down*\n"
    actions = svc.step(now=now)
    assert [(a.kind, a.node) for a in actions] == [("stop", MASTER)]  # no seventh start
    assert svc.state.stop_reason == f"waiting for {WORKER} to come back since {logic.hhmm(T0)}"


def test_a_node_back_for_long_enough_starts_a_new_wait():
    # The other side of the bound: preemptions RECOVERED_S apart are separate waits, not one.
    state = logic.State(cluster="demo", zone=ZONE, master=MASTER, workers=[WORKER],
                        autostop_s=60.0, capacity_wait_s=3600.0)  # fmt: skip
    pending = (logic.QueuedJob("7", "PENDING", "BeginTime", ()),)
    up = {MASTER: logic.Vm(MASTER, "RUNNING", False), WORKER: logic.Vm(WORKER, "RUNNING", False)}
    down = {**up, WORKER: logic.Vm(WORKER, "TERMINATED", True)}
    assert logic.decide(state, logic.Seen(vms=down, jobs=pending, sessions=0), 1000.0)[0] == [
        logic.Action("start", WORKER)
    ]
    logic.started(state, WORKER, 1001.0)
    logic.resumed(state, WORKER, 1100.0)
    later = 1100.0 + logic.RECOVERED_S
    logic.decide(state, logic.Seen(vms=up, jobs=pending, sessions=0), later)
    assert state.nodes[WORKER].down_since is None
    logic.decide(state, logic.Seen(vms=down, jobs=pending, sessions=0), later + 10)
    assert state.nodes[WORKER].down_since == later + 10 and state.autostop_at == later + 10 + 3600
