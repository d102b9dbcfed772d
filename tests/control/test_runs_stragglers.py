"""A run's current stragglers, read from its events.jsonl as the launcher writes it (dtrain.common.metrics'
record_event, what remote.py's _on_alive calls), and the stacks of its hung ranks: dtrain.control.runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dtrain.common.metrics import record_event
from dtrain.common.storage import open_store
from dtrain.control import runs

SLOW = {"h1 rank 1": 2.31}
MESSAGE = "dtrain: straggler: h1 rank 1 (2.3x the others' median step)"


def make_run(out: Path, name: str, state: str = "running") -> Path:
    """A run directory as a launch leaves it; "running" on another host, so no process of this machine is
    looked for (a cluster run)."""
    run = out / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"workload": "mnist", "created": time.time() - 60, "world_size": 4}))
    (run / "status.json").write_text(json.dumps({"state": state, "host": "elsewhere", "pid": 1, "updated": 0}))
    return run


def straggler(run: Path, found: dict[str, float], message: str = MESSAGE) -> None:
    record_event(open_store(str(run)), None, "straggler", message, stragglers=found)


def test_the_last_straggler_row_holds_until_one_says_none(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1")
    store = open_store(str(run))
    assert runs.current_stragglers(store) == {}  # no events.jsonl yet
    record_event(store, 0, "started", "started on 4 process(es)")
    straggler(run, SLOW)
    assert runs.current_stragglers(store) == SLOW
    record_event(store, 100, "checkpoint", "saved step 100")
    assert runs.current_stragglers(store) == SLOW  # other events leave it
    straggler(run, {"h1 rank 1": 2.5, "h0 rank 3": 1.6})
    assert runs.current_stragglers(store) == {"h1 rank 1": 2.5, "h0 rank 3": 1.6}
    straggler(run, {}, "dtrain: no straggler any more")
    assert runs.current_stragglers(store) == {}


def test_a_hang_or_a_new_start_clears_them(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1")
    store = open_store(str(run))
    straggler(run, SLOW)
    assert runs.current_stragglers(store) == SLOW
    record_event(store, 120, "hang", "dtrain: hang on h1 rank 1: no progress for 40 s since step 120", node="h1")
    assert runs.current_stragglers(store) == {}
    straggler(run, SLOW)
    # The restarted attempt's launcher measures afresh: until it reports one, there is none.
    record_event(store, 0, "started", "started on 4 process(es)")
    assert runs.current_stragglers(store) == {}


def test_only_a_running_run_has_stragglers(tmp_path: Path) -> None:
    for state in ("completed", "failed", "preempted", "requeued"):
        run = make_run(tmp_path, state, state)
        straggler(run, SLOW)
        assert runs.current_stragglers(open_store(str(run))) == {}, state
        assert runs.run_summary(str(tmp_path), state)["stragglers"] == {}, state


def test_rows_that_are_not_whole_are_read_as_far_as_they_make_sense(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1")
    store = open_store(str(run))
    straggler(run, SLOW)
    with (run / "events.jsonl").open("a") as f:
        f.write('{"event": "straggler", "stragglers": {"h1 ra')  # being written: left for the next read
    assert runs.current_stragglers(store) == SLOW
    with (run / "events.jsonl").open("a") as f:
        f.write('nk 1": 3.0}}\nnot json\n')
    assert runs.current_stragglers(store) == {"h1 rank 1": 3.0}
    straggler(run, {"h0 rank 0": "slow", "h0 rank 1": True, "h0 rank 2": -1, "h0 rank 3": 1.75})  # type: ignore[dict-item]
    assert runs.current_stragglers(store) == {"h0 rank 3": 1.75}
    record_event(store, None, "straggler", "bad", stragglers="h1 rank 1")
    assert runs.current_stragglers(store) == {}


def test_a_rewritten_events_file_is_read_again_from_its_start(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1")
    store = open_store(str(run))
    straggler(run, SLOW)
    straggler(run, {"h2 rank 0": 4.0})
    assert runs.current_stragglers(store) == {"h2 rank 0": 4.0}
    # A resume rewrites the file: what it says now is what counts, not what the cursor remembers.
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text(
        lines[0] + "\n" + json.dumps({"event": "checkpoint", "step": 5, "pad": "x" * 200}) + "\n"
    )
    assert runs.current_stragglers(store) == SLOW


def test_following_a_long_events_file_reads_only_what_was_appended(tmp_path: Path, monkeypatch) -> None:
    run = make_run(tmp_path, "r1")
    store = open_store(str(run))
    row = json.dumps({"time": 1.0, "step": 1, "event": "checkpoint", "message": "saved " + "x" * 60})
    (run / "events.jsonl").write_text((row + "\n") * 100_000)  # 9 MB: far more events than a run writes
    straggler(run, SLOW)
    reads: list[int] = []
    real_read = runs._read

    def counted(r, name, start):  # noqa: ANN001, ANN202 - runs._read's own signature
        data = real_read(r, name, start)
        reads.append(len(data))
        return data

    monkeypatch.setattr(runs, "_read", counted)
    assert runs.current_stragglers(store) == SLOW
    assert sum(reads) >= 9_000_000, reads  # the first call reads the whole file
    size = (run / "events.jsonl").stat().st_size
    straggler(run, {}, "dtrain: no straggler any more")
    added = (run / "events.jsonl").stat().st_size - size
    reads.clear()
    assert runs.current_stragglers(store) == {}
    assert 0 < sum(reads) <= added + 1, (reads, added)  # then only the row appended (and the byte before it)


def test_the_runs_table_and_run_detail_carry_them(tmp_path: Path) -> None:
    run = make_run(tmp_path, "mnist-b")
    make_run(tmp_path, "mnist-a", "completed")
    straggler(run, SLOW)
    straggler(tmp_path / "mnist-a", SLOW)
    rows = {r["run_id"]: r for r in runs.runs_table(str(tmp_path))}
    assert rows["mnist-b"]["stragglers"] == SLOW and rows["mnist-a"]["stragglers"] == {}
    assert {r["run_id"]: r["stragglers"] for r in runs.list_runs(str(tmp_path))} == {"mnist-b": SLOW, "mnist-a": {}}
    assert runs.run_detail(str(tmp_path), "mnist-b")["summary"]["stragglers"] == SLOW
    # The run ends: its row says none, whatever its last straggler row said.
    (run / "status.json").write_text(json.dumps({"state": "completed", "updated": time.time()}))
    assert runs.run_summary(str(tmp_path), "mnist-b")["stragglers"] == {}


def test_label_puts_the_slowest_first_with_the_launchers_one_decimal() -> None:
    assert runs.stragglers_label({}) == ""
    assert runs.stragglers_label(SLOW) == "h1 rank 1 (2.3x)"
    label = runs.stragglers_label({"h0 rank 3": 1.75, "h1 rank 1": 2.25, "h0 rank 2": 1.75})
    assert label == "h1 rank 1 (2.2x), h0 rank 2 (1.8x), h0 rank 3 (1.8x)"  # f"{x:.1f}", as remote.py's message


def test_hang_stacks_are_the_files_the_launcher_saved(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1")
    assert runs.hang_stacks(open_store(str(run))) == []
    (run / "hangs").mkdir()
    (run / "hangs" / "h1-rank1.txt").write_text(
        'Thread 0x1 (most recent call first):\n  File "train.py", line 9 in step\n'
    )
    (run / "hangs" / "h1-rank0.txt").write_text("Thread 0x2:\n")
    (run / "hangs" / "notes.md").write_text("not a stack")
    stacks = runs.hang_stacks(open_store(str(run)))
    assert [s["name"] for s in stacks] == ["h1-rank0.txt", "h1-rank1.txt"]
    assert 'File "train.py", line 9 in step' in stacks[1]["text"] and stacks[1]["bytes"] == len(stacks[1]["text"])
