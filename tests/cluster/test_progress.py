"""Rank 0's progress travels from a node to the launcher as machine-readable lines
(DTRAIN_INTERNAL_PROGRESS=1), at most two a second plus the last, and the launcher's NodeAgents turns
them into its own progress bar instead of printing them."""

from __future__ import annotations

import json

from dtrain.common import metrics
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Collector, Handle
from dtrain.control.remote import PROGRESS_PREFIX, NodeAgents


def test_reporter_emits_progress_lines(monkeypatch, capsys):
    monkeypatch.setenv("DTRAIN_INTERNAL_PROGRESS", "1")
    r = metrics.Reporter(enabled=True)
    r.start_progress(total=100, completed=0, description="train")
    for step in range(1, 101):
        r.advance(step, f"loss {1 / step:.3f}")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(PROGRESS_PREFIX)]
    events = [json.loads(ln[len(PROGRESS_PREFIX) :]) for ln in lines]
    assert events[0] == {"total": 100, "completed": 0, "description": "train", "status": ""}
    assert events[-1] == {"total": 100, "completed": 100, "description": "train", "status": "loss 0.010"}
    assert len(events) < 10  # throttled: the loop above takes far less than a second


def test_other_ranks_and_plain_runs_emit_nothing(monkeypatch, capsys):
    monkeypatch.setenv("DTRAIN_INTERNAL_PROGRESS", "1")
    metrics.Reporter(enabled=False).start_progress(total=5, completed=0, description="train")
    monkeypatch.delenv("DTRAIN_INTERNAL_PROGRESS")
    r = metrics.Reporter(enabled=True)
    r.start_progress(total=5, completed=0, description="train")
    r.advance(5)
    assert PROGRESS_PREFIX not in capsys.readouterr().out


def test_job_keeps_progress_lines_out_of_the_output():
    c = Cluster(name="c", backend="hosts", nodes=(Node(name="n0", address="10.0.0.1", master=True),))
    events = Collector()
    job = NodeAgents(ssh=None, cluster=c, run_id="r", specs={}, logs=None, events=events, handle=Handle(), echo=False)  # type: ignore[arg-type]
    job._show("n0", PROGRESS_PREFIX + json.dumps({"total": 3, "completed": 1, "description": "train"}))
    job._show("n0", "epoch 1/1: eval accuracy 0.9")
    assert job.output == [("n0", "epoch 1/1: eval accuracy 0.9")]
    assert [e.as_dict() for e in events.of("progress")] == [
        {"kind": "progress", "message": "", "time": events.events[0].time, "total": 3, "completed": 1,
         "description": "train"}
    ]  # fmt: skip
