"""Resource curves (dtrain.common.resources): the sampler on real processes of this machine, the recorder's file
and status.json peaks, the node agent's "resources" lines, their way through the SSH launcher and Slurm's batch
step, and NVML's side as far as this machine (no GPU, no driver) can honestly take it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from gpu_check import GPU_SKIP_REASON, machine_has_gpu
from memory_holders import HOLD, MIB, hold

from dtrain.common import resources, runrecord, slurmstep
from dtrain.common.nodeagent import CONTROL_PREFIX
from dtrain.common.storage import Store, open_store


@pytest.fixture
def no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test process is not a rank (a launcher's process never is): its children are ranks by their own RANK."""
    monkeypatch.delenv("RANK", raising=False)


def test_a_sample_has_the_nodes_cpu_and_memory_and_each_ranks_rss_and_peak(no_rank) -> None:
    ranked, plain = hold(48, RANK="3"), hold(8)
    try:
        s = resources.Sampler(gpus=False)
        time.sleep(0.2)
        row = s.sample([os.getpid(), ranked.pid, plain.pid])
    finally:
        for p in (ranked, plain):
            p.kill()
            p.wait()
    assert 0.0 <= row["cpu_pct"] <= 100.0
    assert 0 < row["mem_used"] < row["mem_total"]
    assert set(row["ranks"]) == {"3"}  # only the process with RANK
    r = row["ranks"]["3"]
    assert r["rss"] >= 48 * MIB and r["hwm"] >= r["rss"]
    assert row["tree_rss"] >= r["rss"] + 8 * MIB  # the whole tree, ranks or not
    assert "gpus" not in row
    assert 0 <= row["sample_ms"] < 1000


def test_a_ranks_own_children_are_not_ranks(no_rank) -> None:
    """A data loader worker inherits RANK from its rank: it is counted in the tree, not as a rank of its own."""
    code = f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {HOLD!r}, '4']); p.wait()"
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": "0"})
    try:
        from dtrain.common.nodeagent import tree

        deadline = time.monotonic() + 20
        while len(pids := tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = resources.Sampler(gpus=False)
        assert [s.rank_of(p) for p in pids] == [0, None]
    finally:
        for p in reversed(tree(parent.pid)):
            os.kill(p, 9)
        parent.wait()


def made_run(url: str) -> Store:
    """A run's store with its config.json (what a launcher or a built-in writes first): a run the curves keep."""
    run = open_store(url)
    run.write_bytes("config.json", b'{"workload": "t"}')
    return run


def row(t: float, rss: int, *, rank: str = "0", gpu: int | None = None) -> dict:
    r = {"rss": rss, "hwm": rss}
    if gpu is not None:
        r["gpu"] = gpu
    return {"time": t, "cpu_pct": 50.0, "mem_used": 1 << 30, "mem_total": 4 << 30, "tree_rss": rss, "ranks": {rank: r}}


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_recorder_keeps_a_bounded_file_over_the_whole_span(tmp_path: Path) -> None:
    run = made_run(str(tmp_path / "run"))
    rec = resources.Recorder(run, max_rows=10)
    for i in range(100):
        rec.add("n1", row(1000.0 + i, (i + 1) * MIB))
    rec.close()
    kept = rows_of(tmp_path / "run" / "resources" / "n1.jsonl")
    times = [r["time"] for r in kept]
    assert len(kept) < 10 and times == sorted(times) and len(set(times)) == len(times)
    assert times[0] == 1000.0 and times[-1] >= 1000.0 + 100 - 16  # the whole span, at a coarser step
    assert all(r["node"] == "n1" for r in kept)
    # The peak is every row's, kept or thinned out: the last (largest) row was offered after the last kept one.
    peaks = runrecord.read_status(run)["peak_memory"]
    assert peaks == {"0": {"node": "n1", "rss_peak": 100 * MIB}}


def test_a_run_that_was_never_made_or_was_removed_keeps_no_curves(tmp_path: Path) -> None:
    """A built-in that refuses its input deletes its run while the sampler goes on: the rows are not left behind,
    and no status.json is made for the peaks."""
    gone = open_store(str(tmp_path / "gone"))
    rec = resources.Recorder(gone)
    rec.add("n1", row(1.0, MIB))
    rec.close()
    assert not (tmp_path / "gone").exists()
    started = open_store(str(tmp_path / "started"))  # record_start's status.json, and no config.json
    before = runrecord.record_start(started, starts=1, host="h")
    rec = resources.Recorder(started)
    rec.add("n1", row(1.0, MIB))
    rec.close()
    assert before is None and [p.name for p in (tmp_path / "started").iterdir()] == ["status.json"]
    assert "peak_memory" not in runrecord.read_status(started)


def test_a_start_that_refused_its_input_changes_nothing_in_the_run(tmp_path: Path) -> None:
    """A resume refused for bad input (exit 2: other model settings, say) ends within seconds, while the sampler
    has already added rows: the run's files are as the earlier start left them, byte for byte, and a node that
    had no file has none (tests/lora/test_bad_inputs.py's refused resume compares the whole run)."""
    run = made_run(str(tmp_path / "run"))
    first = resources.Recorder(run)
    first.add("n1", row(1.0, 300 * MIB))
    first.close()
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    refused = resources.Recorder(run, flush_s=0.0)  # rows reach the file at once, before the job ends
    refused.add("n1", row(2.0, 900 * MIB))
    refused.add("n2", row(2.0, 100 * MIB, rank="1"))
    assert len(rows_of(tmp_path / "run" / "resources" / "n1.jsonl")) == 2
    refused.close(refused=True)
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
    fresh = made_run(str(tmp_path / "fresh"))  # a run with no curves yet keeps none, nor their folder
    rec = resources.Recorder(fresh, flush_s=0.0)
    rec.add("n1", row(1.0, MIB))
    rec.close(refused=True)
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == ["config.json"]


def test_a_resumed_runs_file_over_the_bound_is_thinned_in_the_run(tmp_path: Path) -> None:
    run = made_run(str(tmp_path / "run"))
    first = resources.Recorder(run)
    for i in range(20):
        first.add("n1", row(float(i), MIB))
    first.close()
    again = resources.Recorder(run, max_rows=8)  # a later start, with a smaller bound than the file has
    again.add("n1", row(20.0, MIB))
    again.close()
    times = [r["time"] for r in rows_of(tmp_path / "run" / "resources" / "n1.jsonl")]
    assert len(times) < 8 and times[0] == 0.0 and times == sorted(times), times


def test_peaks_are_the_largest_of_every_start_and_node(tmp_path: Path) -> None:
    run = made_run(str(tmp_path / "run"))
    runrecord.record_start(run, starts=1, host="h")
    first = resources.Recorder(run)
    first.add("n1", row(1.0, 300 * MIB, gpu=2 << 30))
    first.add("n2", row(1.0, 100 * MIB, rank="1"))
    first.close()
    first.add("n1", row(2.0, 900 * MIB))  # after close: dropped (the launcher records the end next)
    runrecord.record_end(run, 3)
    runrecord.record_start(run, starts=2, host="h")
    again = resources.Recorder(run)  # a resumed run: the file goes on, the earlier peaks stay
    again.add("n1", row(5.0, 200 * MIB))
    again.add("n2", row(5.0, 150 * MIB, rank="1", gpu=1 << 30))
    again.close()
    status = runrecord.read_status(run)
    assert status["state"] == "running" and status["starts"] == 2
    assert status["peak_memory"] == {
        "0": {"node": "n1", "rss_peak": 300 * MIB, "gpu_peak": 2 << 30},
        "1": {"node": "n2", "rss_peak": 150 * MIB, "gpu_peak": 1 << 30},
    }
    assert [r["time"] for r in rows_of(tmp_path / "run" / "resources" / "n1.jsonl")] == [1.0, 5.0]


def test_status_json_is_left_alone_while_the_job_runs(tmp_path: Path) -> None:
    """A built-in's rank 0 rewrites status.json as it runs: the recorder writes it only at the end (close), so no
    field either writes is lost; meanwhile the rows' own high-water marks are the peaks so far."""
    run = made_run(str(tmp_path / "run"))
    runrecord.record_start(run, starts=1, host="h")
    before = (tmp_path / "run" / "status.json").read_bytes()
    rec = resources.Recorder(run)
    rec.add("n1", row(1.0, 10 * MIB))
    rec.add("n1", row(2.0, 30 * MIB))
    rec.add("n2", row(2.0, 20 * MIB, rank="1"))
    assert (tmp_path / "run" / "status.json").read_bytes() == before
    so_far = resources.series_peaks(resources.read_series(run))
    assert so_far == {"0": {"node": "n1", "rss_peak": 30 * MIB}, "1": {"node": "n2", "rss_peak": 20 * MIB}}
    rec.close()
    assert runrecord.read_status(run)["peak_memory"] == so_far


def test_read_series_gives_each_nodes_curves_and_spaces_a_long_one_out(tmp_path: Path) -> None:
    run = made_run(str(tmp_path / "run"))
    rec = resources.Recorder(run)
    for i in range(50):
        r = row(100.0 + i, MIB)
        r["gpus"] = [{"index": 0, "util_pct": i, "mem_used": i * MIB, "mem_total": 80 << 30}]
        rec.add("n1", r)
    rec.add("n2", row(100.0, MIB))
    rec.close()
    (tmp_path / "run" / "resources" / "n2.jsonl").open("a").write("not json\n")  # a torn last line is skipped
    s = resources.read_series(run, points=10)
    assert sorted(s) == ["n1", "n2"]
    n1 = s["n1"]
    assert len(n1["time"]) == 10 and n1["time"][0] == 100.0 and n1["time"][-1] == 149.0
    assert n1["mem_total"] == 4 << 30 and len(n1["cpu_pct"]) == 10
    assert n1["gpu_util_pct"][0][-1] == 49 and n1["gpu_mem_total"] == [80 << 30]
    assert s["n2"]["time"] == [100.0] and "gpu_util_pct" not in s["n2"]
    assert resources.read_series(open_store(str(tmp_path / "none"))) == {}


def test_no_pynvml_means_no_gpus_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    g = resources.Gpus()
    assert g.sample() == ([], {}) and "not installed" in g.why


def test_the_real_nvml_answers_or_says_why() -> None:
    """The real nvidia-ml-py (the train extra): on a machine with no NVIDIA driver (this one), NVML's own error
    and no GPUs, no exception; with a driver, a row for every GPU."""
    import pynvml  # noqa: F401 - a dependency: missing, this fails rather than skips

    g = resources.Gpus()
    gpus, _ = g.sample()
    g.close()
    if Path("/proc/driver/nvidia").exists():
        assert gpus and all(x["mem_total"] > 0 for x in gpus), g.why
    else:
        assert gpus == [] and g.why.startswith("NVML: ")


class FakeNvml(types.ModuleType):
    """NVML's Python API as nvidia-ml-py spells it, answering for two GPUs: the parsing and recording path's
    stand-in on a machine without a driver (the real thing runs in tests/gpu on a lent GPU)."""

    class NVMLError(Exception):
        pass

    def __init__(self, pids: dict[int, int]) -> None:
        super().__init__("pynvml")
        self.pids, self.shut = pids, False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return types.SimpleNamespace(used=(h + 1) << 30, total=80 << 30, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.pids.items()] if h == 0 else \
               [types.SimpleNamespace(pid=1, usedGpuMemory=None)]  # fmt: skip


def test_gpu_rows_and_each_ranks_gpu_memory_reach_the_run(no_rank, monkeypatch, tmp_path: Path) -> None:
    ranked = hold(4, RANK="0")
    fake = FakeNvml({ranked.pid: 3 << 30})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    try:
        s = resources.Sampler()
        r = s.sample([ranked.pid])
        s.close()
    finally:
        ranked.kill()
        ranked.wait()
    assert fake.shut
    assert r["gpus"] == [
        {"index": 0, "util_pct": 87, "mem_used": 1 << 30, "mem_total": 80 << 30},
        {"index": 1, "mem_used": 2 << 30, "mem_total": 80 << 30},  # no utilisation where NVML has none
    ]
    assert r["ranks"]["0"]["gpu"] == 3 << 30
    run = made_run(str(tmp_path / "run"))
    rec = resources.Recorder(run)
    rec.add("g1", r)
    rec.close()
    assert runrecord.read_status(run)["peak_memory"]["0"]["gpu_peak"] == 3 << 30


def agent_spec(interval: float, seconds: float) -> dict:
    code = f"import time; b = bytearray(32 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep({seconds})"
    return {"argv": [sys.executable, "-c", code], "env": {"RANK": "5"}, "grace_s": 5, "hang": {"timeout_s": 0},
            "resources": {"interval_s": interval}}  # fmt: skip


def agent_rows(spec: dict) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    # stdin stays open while the job runs: the agent stops a job whose launcher closed it.
    p = subprocess.Popen([sys.executable, "-m", "dtrain.common.nodeagent", "run"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(json.dumps(spec) + "\n")
    p.stdin.flush()
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0
    p.stdin.close()
    lines = [json.loads(x[len(CONTROL_PREFIX) :]) for x in out.splitlines() if x.startswith(CONTROL_PREFIX)]
    return [x for x in lines if x.get("event") == resources.EVENT]


def test_the_node_agent_prints_a_resources_line_every_interval() -> None:
    t0 = time.time()
    rows = agent_rows(agent_spec(0.25, 2.0))
    wall = time.time() - t0
    times = [r["time"] for r in rows]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # One row every 0.25 s while the job ran (2 s of it at least; the agent's whole life bounds it).
    assert 2.0 / 0.25 - 2 <= len(rows) <= wall / 0.25 + 1, (len(rows), wall)
    assert all(g >= 0.24 for g in gaps) and sorted(gaps)[len(gaps) // 2] < 0.5, gaps
    assert max(r["ranks"].get("5", {}).get("hwm", 0) for r in rows) >= 32 * MIB
    assert all(0 <= r["cpu_pct"] <= 100 and r["mem_total"] > 0 for r in rows)


def test_the_node_agent_samples_nothing_when_the_spec_asks_for_none() -> None:
    spec = agent_spec(0.25, 1.0)
    del spec["resources"]  # a launcher from before resource curves
    assert agent_rows(spec) == []


def test_the_ssh_launcher_and_slurms_batch_step_record_the_agents_lines(monkeypatch, tmp_path: Path) -> None:
    from dtrain.control.events import Events, Handle
    from dtrain.control.remote import NodeAgents

    line = CONTROL_PREFIX + json.dumps({"event": resources.EVENT, **row(10.0, 64 * MIB, rank="2")})
    ssh_run = made_run(str(tmp_path / "ssh"))
    rec = resources.Recorder(ssh_run)
    job = NodeAgents(None, None, "r", {}, None, events=Events(), handle=Handle(), resources=rec)  # type: ignore[arg-type]
    job._show("h1", line)
    rec.close()
    assert rows_of(tmp_path / "ssh" / "resources" / "h1.jsonl")[0]["ranks"]["2"]["rss"] == 64 * MIB
    assert runrecord.read_status(ssh_run)["peak_memory"] == {"2": {"node": "h1", "rss_peak": 64 * MIB}}

    # Slurm: the node's step forwards the line with its node's name; the batch step records it.
    said: list[str] = []
    monkeypatch.setattr(slurmstep, "say", said.append)
    slurmstep.forward_control(line, "s1")
    assert said and said[0].startswith(CONTROL_PREFIX)
    slurm_run = made_run(str(tmp_path / "slurm"))
    rec = resources.Recorder(slurm_run)
    assert slurmstep.record_resources(rec, said[0])
    assert not slurmstep.record_resources(rec, CONTROL_PREFIX + json.dumps({"event": "alive", "node": "s1"}))
    rec.close()
    assert rows_of(tmp_path / "slurm" / "resources" / "s1.jsonl")[0]["node"] == "s1"
    assert runrecord.read_status(slurm_run)["peak_memory"]["2"]["node"] == "s1"


GPU_RANK = """
import time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
y = torch.randn(4096, 4096, device="cuda")
print("ready", flush=True)
end = time.time() + 60
while time.time() < end:
    y = (y @ y).tanh_()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not machine_has_gpu(), reason=GPU_SKIP_REASON)
def test_on_a_gpu_the_sample_has_each_gpu_and_the_ranks_gpu_memory(no_rank) -> None:
    """The real NVML on a real GPU: a rank holding 1 GiB and keeping its GPU busy."""
    p = subprocess.Popen([sys.executable, "-c", GPU_RANK], env={**os.environ, "RANK": "0"}, stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        s = resources.Sampler()
        assert s.gpus is not None and s.gpus.nvml is not None, s.gpus.why if s.gpus else ""
        time.sleep(1.0)
        row = s.sample([p.pid])
        s.close()
    finally:
        p.kill()
        p.wait()
    assert row["gpus"] and all(0 <= g["util_pct"] <= 100 and 0 < g["mem_used"] <= g["mem_total"] for g in row["gpus"])
    assert max(g["util_pct"] for g in row["gpus"]) > 0  # the matmuls keep one busy
    assert row["ranks"]["0"]["gpu"] >= 1 << 30  # NVML's per-process accounting: the 1 GiB tensor and more


def test_a_buckets_run_gets_its_rows_in_batches_and_thinned(gcs_emulator: str, monkeypatch) -> None:
    """gs:// (gcp-storage-emulator): the rows go out every REMOTE_FLUSH_S and at the end, a thinning rewrites the
    object, and the curves and the peaks read back."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    storage.Client(project="p", credentials=AnonymousCredentials()).create_bucket("curves")
    run = made_run("gs://curves/runs/t-1")
    rec = resources.Recorder(run, max_rows=6)
    assert rec.flush_s == resources.REMOTE_FLUSH_S
    for i in range(3):
        rec.add("n1", row(float(i), (i + 1) * MIB))
    assert not run.exists("resources/n1.jsonl")  # batched: nothing sent yet
    for i in range(3, 10):
        rec.add("n1", row(float(i), (i + 1) * MIB))
    rec.close()
    times = [r["time"] for r in resources.read_rows(run, "resources/n1.jsonl")]
    assert len(times) < 6 and times[0] == 0.0 and times == sorted(times), times
    assert resources.read_series(run)["n1"]["time"] == times
    assert runrecord.read_status(run)["peak_memory"] == {"0": {"node": "n1", "rss_peak": 10 * MIB}}


def test_a_slurm_job_in_an_image_publishes_each_starts_rows_and_peaks_at_its_end(monkeypatch, tmp_path: Path) -> None:
    """Container mode: the batch step's node has no storage libraries, so the rows wait in the job's directory and
    one `slurmstep resources` in the job's image (run here in-process: no Docker) adds them to the run per start."""
    job_dir, run_dir = tmp_path / "job", tmp_path / "runs" / "r"
    job_dir.mkdir()
    job = {"image": "img:1", "run_url": str(run_dir), "specs": {"*": {"env": {}}}}
    (job_dir / "job.json").write_text(json.dumps(job))
    monkeypatch.chdir(job_dir)
    containers: list[list[str]] = []

    def in_image(job: dict, args: list[str], *, capture: bool = False) -> None:
        containers.append(args)
        monkeypatch.setenv(slurmstep.IN_IMAGE_ENV, "1")
        assert slurmstep.main(args) == 0
        monkeypatch.delenv(slurmstep.IN_IMAGE_ENV)

    monkeypatch.setattr(slurmstep, "in_image", in_image)
    run = made_run(str(run_dir))
    for start, (t, rss) in enumerate(((1.0, 40 * MIB), (9.0, 30 * MIB))):
        runrecord.record_start(run, starts=start + 1, host="b")
        rec = slurmstep.resources_recorder(job)
        assert isinstance(rec, slurmstep.ImageResources)
        for i in range(3):
            rec.add("s1", row(t + i, rss))
        # Nothing reaches the run while the start runs.
        assert len(resources.read_rows(run, "resources/s1.jsonl")) == 3 * start
        rec.close()
        assert not (job_dir / slurmstep.RESOURCES_STAGING).exists()
    assert [a[0] for a in containers] == ["resources", "resources"]  # one container a start, not one a row
    assert [r["time"] for r in rows_of(run_dir / "resources" / "s1.jsonl")] == [1.0, 2.0, 3.0, 9.0, 10.0, 11.0]
    assert runrecord.read_status(run)["peak_memory"] == {"0": {"node": "s1", "rss_peak": 40 * MIB}}


def test_the_sampler_is_made_and_its_imports_done_in_the_starting_thread(monkeypatch) -> None:
    """A thread importing at the moment the launcher forks a job with a preexec_fn leaves the child waiting on an
    import lock forever (the local launcher hung so): start() makes the Sampler, NVML's import included, before
    the thread runs."""
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    t = resources.SamplerThread(60.0, lambda: [], lambda _row: None)
    t.start()
    try:
        assert t.sampler is not None and "pynvml" in sys.modules
    finally:
        t.close()
