"""metrics.jsonl and events.jsonl grow while a run trains, and are never rewritten: a local run's line
is in the file as soon as it is logged; a run in a bucket's within metrics.FLUSH_EVERY_S, appended with
a server-side compose (gcp-storage-emulator here)."""

from __future__ import annotations

import json
import os
import time

import pytest

from dtrain.common import metrics
from dtrain.common.metrics import Reporter
from dtrain.common.storage import open_store


def lines(store, name="metrics.jsonl") -> list[dict]:
    try:
        return [json.loads(ln) for ln in store.read_bytes(name).decode().splitlines()]
    except FileNotFoundError:
        return []


def test_a_local_line_is_in_the_file_when_logged_and_the_file_only_grows(tmp_path):
    run = open_store(str(tmp_path / "run"))
    r = Reporter(enabled=True, store=run)
    r.log(1, loss=2.0)
    path = tmp_path / "run" / "metrics.jsonl"
    inode = os.stat(path).st_ino
    for step in range(2, 6):
        r.log(step, loss=1.0 / step)
        assert [m["step"] for m in lines(run)] == list(range(1, step + 1))  # no flush needed
    assert os.stat(path).st_ino == inode  # appended to, not replaced
    r.close()
    assert [m["step"] for m in lines(run)] == [1, 2, 3, 4, 5]


def test_resume_drops_the_replayed_steps_once(tmp_path):
    run = open_store(str(tmp_path / "run"))
    r = Reporter(enabled=True, store=run)
    for step in (10, 20, 30):
        r.log(step, loss=1.0)
    r.close()
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")  # a torn line from a killed run
    r = Reporter(enabled=True, store=run, resume=True)
    r.rewind(20)
    r.log(30, loss=0.5)
    r.close()
    assert [(m["step"], m["loss"]) for m in lines(run)] == [(10, 1.0), (20, 1.0), (30, 0.5)]


def test_events_are_appended_with_time_step_and_kind(tmp_path):
    run = open_store(str(tmp_path / "run"))
    r = Reporter(enabled=True, store=run)
    before = time.time()
    r.event(0, "started", "started on 2 process(es)", world_size=2)
    r.event(16, "checkpoint", "checkpoint step 16 saved")
    r.close()
    rows = lines(run, "events.jsonl")
    assert [(e["event"], e["step"], e["message"]) for e in rows] == [
        ("started", 0, "started on 2 process(es)"),
        ("checkpoint", 16, "checkpoint step 16 saved"),
    ]
    after = time.time()
    assert rows[0]["world_size"] == 2
    assert all(before - 0.001 <= e["time"] <= after + 0.001 for e in rows), (before, after, rows)


def test_other_ranks_write_nothing(tmp_path):
    run = open_store(str(tmp_path / "run"))
    r = Reporter(enabled=False, store=run)
    r.log(1, loss=1.0)
    r.event(1, "started", "x")
    r.close()
    assert not (tmp_path / "run").exists()


def test_a_bucket_run_gets_its_lines_within_the_flush_interval_as_one_ordered_stream(gcs_bucket, monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_EVERY_S", 0.5)
    run = open_store(f"{gcs_bucket}/run")
    r = Reporter(enabled=True, store=run)
    try:
        seen = []
        for round_ in range(3):
            for i in range(4):
                r.log(round_ * 4 + i, loss=float(i))
            deadline = time.monotonic() + 10 * metrics.FLUSH_EVERY_S
            while len(lines(run)) < (round_ + 1) * 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            now = [m["step"] for m in lines(run)]
            assert now == list(range((round_ + 1) * 4)), now  # arrived without a flush() call
            assert now[: len(seen)] == seen  # what a reader saw before is still the start
            seen = now
        r.event(11, "completed", "completed")
        assert [e["event"] for e in lines(run, "events.jsonl")] == ["completed"]
    finally:
        r.close()
    assert [m["step"] for m in lines(run)] == list(range(12))
    assert run.list("") == ["events.jsonl", "metrics.jsonl"]  # no append parts left behind


def test_append_to_a_bucket_object_keeps_every_byte_in_order(gcs_bucket):
    store = open_store(gcs_bucket)
    for i in range(20):
        store.append_bytes("log.txt", f"{i}\n".encode())
    assert store.read_bytes("log.txt").decode().split() == [str(i) for i in range(20)]
    assert store.read_bytes("log.txt", start=len(b"0\n1\n")).decode().split()[0] == "2"
    assert store.read_bytes("log.txt", start=10_000) == b""
    assert store.list("") == ["log.txt"]


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_read_from_an_offset(tmp_path, gcs_bucket, where):
    store = open_store(str(tmp_path) if where == "local" else gcs_bucket)
    store.write_bytes("f", b"abcdef")
    assert store.read_bytes("f", start=2) == b"cdef"
    assert store.read_bytes("f") == b"abcdef"
