"""The cluster service (dtrain.service) on the Slurm test bed, with the Compute fake as the cloud: the bed's
h0 and h1 are instances `h0` (the master, on-demand) and `h1` (Spot) of cluster `bed` in the fake.

A preemption is what GCE does plus what it does to the machine: the fake marks h1 preempted (TERMINATED, a
`compute.instances.preempted` operation) and the test kills every process of h1 (testbed crash). The service,
run here in a thread with Slurm's commands over SSH to h0, starts h1 through the fake; the fake's start hook
revives h1 (sshd, munged, slurmd, as its init would); the service returns it to Slurm and the requeued job
resumes from its checkpoint. The preemption's runs write to gs:// on the storage emulator (on h0, which is
never preempted); the other tests' to the bed's shared directory, as the other Slurm tests' do.

Needs root (network namespaces), slurm-wlm, munge and dataset-fashion-mnist, as tests/slurm/test_slurm_bed.py.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp.compute_fake import ComputeWorld  # noqa: E402
from runs import CLI  # noqa: E402

from dtrain.control.events import Collector, Handle  # noqa: E402
from dtrain.control.settings import load_cluster  # noqa: E402
from dtrain.service import logic  # noqa: E402
from dtrain.service.daemon import Service, ServiceConfig, SshShell  # noqa: E402

from .conftest import SHORT, Env  # noqa: E402
from .test_slurm_bed import latest, status  # noqa: E402

pytestmark = pytest.mark.root

PROJECT, ZONE = "dtrain-test", "us-central1-a"
WORKDIR = "/var/lib/slurm/dtrain"  # the bed's Slurm workdir (hosts_toml's default)


class Cloud:
    """The fake's world for cluster `bed`, the service watching it in a thread, and what it emitted."""

    def __init__(self, bed: Env, **service: object) -> None:
        from google.auth.credentials import AnonymousCredentials

        from dtrain.control.gcp.client import Gcp

        self.bed, self.world = bed, ComputeWorld(PROJECT)
        w = self.world
        w.polls_to_finish = 1
        w.add_region("us-central1", [ZONE])
        for h in ("h0", "h1"):
            w.add_instance(ZONE, h, labels={"dtrain-cluster": "bed"}, spot=h == "h1",
                           internal_ip=bed.sb.host(h).address)  # fmt: skip
        w.on_start = lambda zone, name: bed.sb.revive(bed.sb.host(name))
        self.server = w.serve().__enter__()
        self.gcp = Gcp(PROJECT, AnonymousCredentials(), endpoint=self.server.endpoint)
        cluster = load_cluster(bed.cwd / "dtrain.toml", "bed")
        self.state_file = bed.sb.private(bed.sb.host("h0"), f"{WORKDIR}/service/state.json")
        self.state_file.unlink(missing_ok=True)
        cfg = ServiceConfig(cluster="bed", project=PROJECT, zone=ZONE, master="h0", workers=["h1"], workdir=WORKDIR,
                            state_file=str(self.state_file), poll_s=1.0, **service)  # fmt: skip
        self.shell = SshShell(cluster)
        self.events = Collector()
        self.service = Service(cfg, gcp=self.gcp, shell=self.shell, events=self.events)
        self.handle = Handle()
        self.thread = threading.Thread(target=self.service.run, args=(self.handle,), daemon=True)

    def __enter__(self) -> Cloud:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.terminate()
        self.thread.join(timeout=60)
        self.shell.close()
        self.server.__exit__(None, None, None)
        self.state_file.unlink(missing_ok=True)  # the bed's other tests see no service

    def starts(self) -> int:
        return self.world.called("POST", r"/instances/h1/start$")


def test_an_interactive_login_counts_as_a_session_and_dtrains_commands_do_not(bed: Env) -> None:
    """What autostop counts as someone at work on the master: a login with a terminal on h0, not the
    commands dtrain runs there (no terminal), nor a login on another host (h1)."""
    from dtrain.service.daemon import SESSIONS

    sb = bed.sb
    assert sb.ssh(sb.host("h0"), SESSIONS).stdout.strip() == "0"
    logins = []
    try:
        for h in ("h0", "h1"):
            logins.append(subprocess.Popen(
                ["ssh", "-tt", "-i", str(sb.bed.key), "-o", f"UserKnownHostsFile={sb.known_hosts}", "-o",
                 "BatchMode=yes", f"root@{sb.host(h).address}", "sleep 60"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        deadline = time.monotonic() + 30
        while (n := [sb.ssh(sb.host(h), SESSIONS).stdout.strip() for h in ("h0", "h1")]) != ["1", "1"]:
            assert time.monotonic() < deadline, n  # each host counts its own login only
            time.sleep(0.2)
    finally:
        for p in logins:
            p.kill()
            p.wait()


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(logic, "START_BACKOFF_S", 1.0)
    yield


def _preempt(bed: Env, cloud: Cloud, job: str) -> tuple[str, float]:
    """Wait for the job's first checkpoint, then preempt h1: the machine dies and GCE records it. The run's
    directory or gs:// URL, and the time of the preemption."""
    row = bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    run = row["url"]
    deadline = time.monotonic() + 300
    while latest(run) < 8:
        assert time.monotonic() < deadline, "no checkpoint at step 8"
        time.sleep(0.2)
    at = time.time()
    bed.sb.crash(bed.sb.host("h1"))
    cloud.world.mark_preempted(ZONE, "h1")
    return run, at


def _read(run: str, name: str) -> bytes:
    """A file of a run in a directory or a bucket (STORAGE_EMULATOR_HOST set for gs://)."""
    from dtrain.common.storage import open_store

    return open_store(run).read_bytes(name)


def _json(run: str, name: str) -> dict:
    return json.loads(_read(run, name))


def _weights(run: str) -> dict:
    from safetensors.torch import load

    return load(_read(run, "final/model.safetensors"))


def _service_events(run: str) -> list[tuple[str, str]]:
    rows = [json.loads(ln) for ln in _read(run, "events.jsonl").decode().splitlines() if ln.strip()]
    return [(r["event"], r.get("node", "")) for r in rows if r.get("source") == "dtrain-service"]


@pytest.fixture(scope="module")
def emulator(bed: Env) -> str:
    """gcp-storage-emulator on h0 (the master, never preempted here), reachable from every host."""
    return bed.sb.bed.start_gcs_emulator(bed.sb.host("h0"))


@pytest.fixture
def bucket(emulator: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """gs://<a new bucket>/runs, with STORAGE_EMULATOR_HOST set here, for the CLI (which forwards it to the
    jobs) and for the service running in this process."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
    name = f"dtrain-preempt-{secrets.token_hex(4)}"
    storage.Client(project=PROJECT, credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}/runs"


@pytest.mark.slow
def test_a_preempted_worker_is_restarted_and_the_job_resumes_exactly(
    bed: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket: str, uninterrupted: dict
) -> None:
    """A 2-node job writing to gs:// (the emulator): h1 preempted mid-run, started again by the service,
    returned to Slurm; the requeued job resumes from its checkpoint in the bucket and ends with the weights
    of an uninterrupted run (the session's, in the shared folder: conftest.uninterrupted)."""
    ref = uninterrupted
    with Cloud(bed) as cloud:
        job = bed.submit(*SHORT, "--output", bucket)
        run, _ = _preempt(bed, cloud, job)
        assert run.startswith(bucket + "/"), run
        row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the preemption")
        shown = bed.dtrain("jobs", "--cluster", "bed", "--all")
        # `dtrain status` of the same machines as the gcp cluster they stand for: the Compute fake's view, and
        # the service's section read from the master.
        config = _gcp_bed(bed, cloud.server.endpoint, tmp_path, monkeypatch)
        ep = cloud.server.endpoint
        env = {**bed.env(), "DTRAIN_GCP_COMPUTE_ENDPOINT": ep, "DTRAIN_GCP_API_ENDPOINT": ep, "NO_GCE_CHECK": "True"}
        st = subprocess.run([*CLI, "--config", str(config), "status", "--cluster", "bed"], cwd=bed.cwd, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cloud.starts() == 1 and cloud.service.state.nodes["h1"].restarts == 1
    assert row["restarts"] == 1 and run.endswith("/" + row["run_id"]), row
    said = [(e.kind, e.message) for e in cloud.events.events]
    assert _service_events(run) == [("preempted", "h1"), ("restarted", "h1"), ("resumed", "h1")], said
    assert "service:" in shown.stdout and "h1: 1 restart(s) after preemption" in shown.stdout, shown.stdout
    assert st.returncode == 0, st.stdout + st.stderr
    assert "service:" in st.stdout and "h1: 1 restart(s) after preemption" in st.stdout, st.stdout
    want, got = _weights(ref["url"]), _weights(run)
    assert max((want[k].float() - got[k].float()).abs().max().item() for k in want) <= 1e-6
    assert _json(run, "status.json")["result"]["steps"] == _json(ref["url"], "status.json")["result"]["steps"]
    assert len(_json(run, "config.json").get("resumes", [])) == 1
    for node in ("h0", "h1"):  # each node's log kept in the bucket, with the resume in it
        assert b"dtrain: resume on " + node.encode() in _read(run, f"logs/{node}.log"), node


@pytest.mark.slow
def test_no_capacity_waits_says_so_and_the_job_completes(bed: Env, short_backoff: None) -> None:
    with Cloud(bed) as cloud:
        cloud.world.refuse_starts(3, name="h1")
        job = bed.submit(*SHORT)
        run, _ = _preempt(bed, cloud, job)
        waiting = ""
        deadline = time.monotonic() + 120
        while "waiting for capacity" not in waiting:
            assert time.monotonic() < deadline, "the wait was never shown"
            waiting = bed.dtrain("jobs", "--cluster", "bed").stdout
        row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the wait")
    assert re.search(r"h1: preempted; waiting for capacity in us-central1-a since \d\d:\d\d", waiting), waiting
    assert cloud.starts() == 4 and row["restarts"] == 1
    assert _service_events(run) == [("preempted", "h1"), ("waiting-capacity", "h1"), ("restarted", "h1"),
                                    ("resumed", "h1")]  # fmt: skip
    assert _json(run, "status.json")["result"]["steps"] == 31


def _gcp_bed(bed: Env, endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Cluster `bed` as dtrain's gcp backend sees it after `dtrain up`: a config file with its [clusters.bed]
    gcp table, and the record, key and known_hosts under the bed's XDG config (the record names h0 and h1 at
    their bed addresses, with this Python on the nodes). The Compute fake at `endpoint`; the startup
    script's ready file here. The config file's path."""
    import shutil

    from dtrain.control.gcp import lifecycle
    from dtrain.control.gcp.record import cluster_dir, key_path, write_record

    monkeypatch.setenv("XDG_CONFIG_HOME", str(bed.cwd / "config"))
    for name in ("DTRAIN_GCP_COMPUTE_ENDPOINT", "DTRAIN_GCP_API_ENDPOINT"):
        monkeypatch.setenv(name, endpoint)
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    ready = tmp_path / "ready"
    ready.write_text('{"ok": true}')
    monkeypatch.setattr(lifecycle, "READY_FILE", str(ready))
    sb = bed.sb
    nodes = [{"name": h, "role": "master" if h == "h0" else "worker", "internal_ip": sb.host(h).address,
              "external_ip": sb.host(h).address, "gpus": 0, "python": sys.executable, "workdir": WORKDIR}
             for h in ("h0", "h1")]  # fmt: skip
    write_record({"name": "bed", "backend": "gcp", "project": PROJECT, "region": "us-central1", "zone": ZONE,
                  "bucket": "gs://dtrain-test-bed", "ssh_user": "root", "slurm": True, "nodes": nodes})  # fmt: skip
    shutil.copy(sb.bed.key, key_path("bed"))
    key_path("bed").chmod(0o600)
    shutil.copy(sb.known_hosts, cluster_dir("bed") / "known_hosts")
    config = tmp_path / "gcp.toml"
    config.write_text(
        '[clusters.bed]\nbackend = "gcp"\nproject = "dtrain-test"\nregion = "us-central1"\n'
        'zone = "us-central1-a"\nssh_source_ranges = ["10.0.0.0/8"]\n'
    )
    return config


@pytest.mark.slow
def test_autostop_stops_the_workers_then_the_master_and_submit_starts_them_again(
    bed: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle for 3 s: h1 is stopped, then h0 (the last call). Then a job submitted to the gcp cluster starts
    both again (the master first), waits for them, and runs: `dtrain submit`'s function, called here so
    that the startup script's ready file can be put where this machine's other tests do not look."""
    from dtrain.control.launch import LaunchRequest, submit

    sb = bed.sb
    with Cloud(bed, autostop="3s") as cloud:
        cloud.world.on_stop = lambda zone, name: sb.crash(sb.host(name))
        cloud.thread.join(timeout=120)  # the service ends once it has stopped the master
        assert not cloud.thread.is_alive(), cloud.events.events
        stops = [p.split("/")[-2] for m, p, _ in cloud.world.requests if m == "POST" and p.endswith("/stop")]
        assert stops == ["h1", "h0"]  # the workers first, the master's stop the last call
        assert {cloud.world.instances[(ZONE, h)]["status"] for h in ("h0", "h1")} == {"TERMINATED"}
        deadline = time.monotonic() + 30
        while sb.bed.pids(sb.host("h0")) or sb.bed.pids(sb.host("h1")):  # the fake's hook takes them down
            assert time.monotonic() < deadline
            time.sleep(0.2)
        config = _gcp_bed(bed, cloud.server.endpoint, tmp_path, monkeypatch)
        flags = {"run.cluster": "bed", "run.output": str(bed.runs), "run.nproc": 1, "mnist.dataset": "fashion-mnist",
                 "mnist.epochs": 1, "mnist.train_split": "train[:2000]"}  # fmt: skip
        events = Collector()
        r = submit(LaunchRequest(workload="mnist", flags=flags, config_path=config, nodes=1), events=events,
                   handle=Handle())  # fmt: skip
        starts = [p.split("/")[-2] for m, p, _ in cloud.world.requests if m == "POST" and p.endswith("/start")]
        assert starts == ["h0", "h1"], starts  # the master first
        assert any("cluster bed is stopped (h0, h1): starting it" in e.message for e in events.events)
        row = bed.wait(r.job_id, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the restart")
        result = status(Path(row["url"]))["result"]
        assert result["world_size"] == 1 and result["accuracy"] >= 0.5, result
