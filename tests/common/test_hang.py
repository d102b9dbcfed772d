"""Hang detection (dtrain.common.progress, the node agent's watcher): the rules, the heartbeat, and a real
torchrun job whose rank 1 is frozen with SIGSTOP while the agent runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.common import progress
from dtrain.common.nodeagent import CONTROL_PREFIX, tree
from dtrain.common.progress import Heartbeat, hang_timeout, read_beat, stragglers


def test_timeout_rule() -> None:
    assert hang_timeout([0.05] * 20, None) == progress.FLOOR_S  # fast steps: the floor
    assert hang_timeout([2.0, 4.0, 6.0], None) == pytest.approx(40.0)  # K x the median
    assert hang_timeout([0.1, 0.1], None) == progress.NO_STEP_TIMEOUT_S  # too few steps seen yet
    assert hang_timeout([0.1], None, steps=12) == progress.FLOOR_S  # one heartbeat change can span many steps
    assert hang_timeout([], 12.5) == 12.5  # --hang-timeout wins, from the start
    assert hang_timeout([100.0] * 5, 7) == 7


def test_straggler_rule() -> None:
    assert stragglers({"0": 1.0, "1": 1.1, "2": 0.9, "3": 2.0}) == {"3": 2.0}
    assert stragglers({"0": 1.0, "1": 1.4}) == {}  # within 1.5x
    assert stragglers({"0": 1.0}) == {}  # nothing to compare with
    assert stragglers({"0": 1.0, "1": 3.1}) == {"1": 3.1}


def test_heartbeat_written_at_most_once_a_second(tmp_path: Path) -> None:
    hb = Heartbeat(str(tmp_path), "3", every_s=0.3)
    hb(1)
    first = read_beat(tmp_path / "rank-3")
    hb(2)  # within 0.3 s: not written
    assert first is not None and first[0] == 1 and read_beat(tmp_path / "rank-3") == first
    time.sleep(0.35)
    hb(5)
    got = read_beat(tmp_path / "rank-3")
    assert got is not None and got[0] == 5 and got[1] >= first[1] + 0.3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-3"]  # no temporary left


def test_sdk_log_beats_on_every_rank(tmp_path: Path) -> None:
    code = "from dtrain import sdk\nfor s in range(3): sdk.log(s, loss=1.0)\n"
    for rank in ("0", "1"):
        env = {**os.environ, "DTRAIN_PROGRESS_DIR": str(tmp_path), "RANK": rank}
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        got = read_beat(tmp_path / f"rank-{rank}")
        assert got is not None and got[0] == 0 and abs(got[1] - time.time()) < 30  # first call written, rest throttled


SCRIPT = """
import os, time
import torch
import torch.distributed as dist
from dtrain import sdk

def train_loop_body(step):
    t = torch.ones(4)
    dist.all_reduce(t)
    time.sleep(0.05)
    sdk.log(step, loss=float(t[0]))
    if step % 10 == 0:
        print(f"rank {dist.get_rank()} step {step}", flush=True)

dist.init_process_group("gloo")
for step in range(100000):
    train_loop_body(step)
"""


def test_agent_finds_a_stopped_rank_saves_its_stack_and_stops_the_job(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    spec = {
        "argv": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(tmp_path / "job.py")],
        "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        "grace_s": 5,
        "hang": {"timeout_s": 4},
    }  # fmt: skip
    t0 = time.monotonic()
    agent = subprocess.Popen(
        [sys.executable, "-m", "dtrain.common.nodeagent", "run"],
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert agent.stdin and agent.stdout
    agent.stdin.write(json.dumps(spec) + "\n")
    agent.stdin.flush()
    lines: list[str] = []
    pids: list[int] = []
    frozen_at = None
    for line in agent.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(CONTROL_PREFIX) and '"started"' in line:
            root = json.loads(line[len(CONTROL_PREFIX) :])["pid"]
        if frozen_at is None and "rank 1 step 20" in line:
            pids = tree(root)
            rank1 = [p for p in pids if progress._rank_of(p) == "1"]
            os.kill(min(rank1), signal.SIGSTOP)  # the rank itself (its parent has no RANK): the lowest pid
            frozen_at = time.monotonic()
        if '"event": "hang"' in line:
            detected_at = time.monotonic()
    rc = agent.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert frozen_at is not None, "\n".join(lines[-20:])
    assert rc == 4, "\n".join(lines[-20:])  # ExitCode.HUNG
    host = socket.gethostname()
    hang_line = [x for x in lines if x.startswith(f"dtrain: hang on {host} rank 1:")]
    assert hang_line and "since step" in hang_line[0] and f"hangs/{host}-rank1.txt" in hang_line[0], lines[-20:]
    stack = (tmp_path / "hangs" / f"{host}-rank1.txt").read_text()
    assert "train_loop_body" in stack and "job.py" in stack, stack
    assert 4 <= detected_at - frozen_at < 10, detected_at - frozen_at
    assert all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in pids)  # nothing left behind
    print(f"freeze -> detection {detected_at - frozen_at:.1f} s (timeout 4 s); whole test {elapsed:.1f} s")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- the launcher's side (dtrain.control.remote.NodeAgents), with real agents on this machine ---------------------

PLAIN = """
import os, sys, time
from dtrain import sdk

def waiting_for_peers(step):
    time.sleep(float(sys.argv[2]))
    sdk.log(step, loss=1.0)

print(f"pid {os.getpid()} rank {os.environ['RANK']}", flush=True)
for step in range(int(sys.argv[1])):
    waiting_for_peers(step)
"""


class LocalShell:
    """NodeAgents' SSH, reduced to what it calls: each node's command runs here, under bash."""

    def popen(self, node, command: str, **kw):  # noqa: ANN001, ANN003, ANN201 - NodeAgents' own signature
        return subprocess.Popen(["bash", "-c", command], start_new_session=True, **kw)


def _job(tmp_path: Path, timeout: float, steps: int, step_s: tuple[float, float] = (0.05, 0.05)):
    from dtrain.common.storage import LocalStore
    from dtrain.control.cluster import Cluster, Node
    from dtrain.control.events import Collector, Handle
    from dtrain.control.remote import LogFiles, NodeAgents, hang_spec

    (tmp_path / "job.py").write_text(PLAIN)
    nodes = tuple(
        Node(name=f"n{i}", address="127.0.0.1", master=i == 0, python=sys.executable, workdir=str(tmp_path / f"n{i}"))
        for i in range(2)
    )
    for n in nodes:
        (Path(n.workdir) / "runs" / "r" / "code").mkdir(parents=True)
    run = LocalStore(tmp_path / "run")
    run.write_bytes("config.json", b"{}")  # a run that started: logs and events go in
    specs = {
        n.name: {"argv": [sys.executable, str(tmp_path / "job.py"), str(steps), str(step_s[i])],
                 "env": {"RANK": str(i)}, "grace_s": 2, "hang": hang_spec(timeout)}
        for i, n in enumerate(nodes)
    }  # fmt: skip
    events = Collector()
    job = NodeAgents(LocalShell(), Cluster(name="c", backend="hosts", nodes=nodes), "r", specs, LogFiles("r", run),  # type: ignore[arg-type]
              events=events, handle=Handle(), echo=False)  # fmt: skip
    return job, events, run


def _run_until(job, pred, within: float) -> None:
    import threading

    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(job.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not pred():
        time.sleep(0.1)
    return t, box


def _pid_of(job, node: str) -> int | None:
    for name, line in list(job.output):
        if name == node and line.startswith("pid "):
            return int(line.split()[1])
    return None


def test_launcher_saves_the_stacks_in_the_run_names_the_node_and_stops_every_node(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    job, events, run = _job(tmp_path, timeout=2, steps=100000)
    t, box = _run_until(job, lambda: _pid_of(job, "n1") and _pid_of(job, "n0"), 20)
    time.sleep(1.5)  # a few steps: heartbeats
    victim, survivor = _pid_of(job, "n1"), _pid_of(job, "n0")
    os.kill(victim, signal.SIGSTOP)
    t.join(timeout=20)
    assert box == [4], (box, job.output[-10:])  # ExitCode.HUNG
    (hang,) = events.of("hang")
    assert hang.message.startswith("dtrain: hang on n1 rank 1: no progress for "), hang.message
    assert hang.message.endswith(f"stacks in {run.join('hangs/n1-rank1.txt')}"), hang.message
    assert "waiting_for_peers" in (tmp_path / "run" / "hangs" / "n1-rank1.txt").read_text()
    rows = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(r["event"], r["node"], r["rank"]) for r in rows] == [("hang", "n1", "1")]
    assert job.first_failure == ("n1", 4)
    # What the run's status.json says of it (userjob.record_end, remote.outcome): the hang, not a crash.
    assert job.hang_error().startswith("hung: no progress for "), job.hang_error()
    assert job.hang_error().endswith(f" on n1 rank 1 since step {hang.data['step']}; stacks in "
                                     f"{run.join('hangs/n1-rank1.txt')}")  # fmt: skip
    for pid in (victim, survivor):
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def test_launcher_shows_a_straggler_and_takes_a_silent_agent_for_a_hung_node(tmp_path: Path, monkeypatch) -> None:
    from dtrain.control import remote

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(remote, "SILENT_FLOOR_S", 1.0)
    # n1's steps take 4x n0's (the ranks do not wait for each other here); the jobs end by themselves in ~30 s.
    job, events, _run = _job(tmp_path, timeout=3, steps=150, step_s=(0.05, 0.2))
    t, box = _run_until(job, lambda: events.of("straggler"), 20)
    (straggler,) = events.of("straggler")
    assert straggler.message.startswith("dtrain: straggler: n1 rank 1 ("), straggler.message
    assert list(straggler.data["stragglers"]) == ["n1 rank 1"] and straggler.data["stragglers"]["n1 rank 1"] > 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["straggler"]  # in the run's events too
    t0 = time.monotonic()
    agent = job.procs["n1"].pid  # bash exec'd the agent: the same process
    os.kill(agent, signal.SIGSTOP)  # the agent, not its job: the node stops answering
    t.join(timeout=20)
    assert box == [4], (box, job.output[-10:])
    (hang,) = events.of("hang")
    assert hang.message.startswith("dtrain: hang on n1: its agent has printed nothing for "), hang.message
    assert job.hang_error().startswith("hung: the agent on n1 printed nothing for "), job.hang_error()
    assert time.monotonic() - t0 < 15
    with contextlib.suppress(ProcessLookupError):
        os.kill(_pid_of(job, "n1"), signal.SIGKILL)  # the frozen node's own job: out of the launcher's reach
