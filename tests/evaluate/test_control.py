"""dtrain.control.evals without the CLI, as the dashboard calls it: plan (the id at once, a pending
record), run with its own Events and Handle, list and read; a stop request ends the evaluation and
its record says so."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.evals import EvalRequest, list_evals, plan_eval, read_eval, run_eval
from dtrain.control.events import Collector, Handle


def test_plan_then_run_then_read(mnist_run: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(mnist_run.parent.parent)  # no dtrain.toml here: the defaults
    output = str(mnist_run.parent)
    plan = plan_eval(EvalRequest(run=mnist_run.name, output=output))
    pending = read_eval(output, mnist_run.name, plan.eval_id)
    assert pending["state"] == "pending" and pending["where"] == "this machine" and pending["workload"] == "mnist"
    events = Collector()
    record = run_eval(plan, events=events, handle=Handle())
    assert record["state"] == "completed" and record["id"] == plan.eval_id
    assert record["where"] == "this machine" and record["created"] == pending["created"]  # the plan's, kept
    assert read_eval(output, mnist_run.name, plan.eval_id) == record
    assert any("evaluating on 1000 images" in e.message for e in events.of("info"))
    listed = list_evals(output, mnist_run.name)
    assert listed[0]["id"] == plan.eval_id  # newest first
    assert [r["id"] for r in listed] == sorted((r["id"] for r in listed), reverse=True)


def test_read_eval_refuses_a_bad_or_unknown_id(mnist_run: Path):
    output = str(mnist_run.parent)
    with pytest.raises(UserError, match=r"'\.\./config' is not an eval id"):
        read_eval(output, mnist_run.name, "../config")
    with pytest.raises(UserError, match=r"has no evaluation eval-20200101-000000-0000 \(its evaluations: "):
        read_eval(output, mnist_run.name, "eval-20200101-000000-0000")


def test_a_stop_request_ends_the_evaluation_and_marks_it_failed(lora_run: Path):
    output = str(lora_run.parent)
    plan = plan_eval(EvalRequest(run=str(lora_run), output=output))
    handle = Handle()
    started = threading.Event()

    class Events(Collector):
        def emit(self, kind: str, message: str = "", **data: object) -> None:
            super().emit(kind, message, **data)
            started.set()  # the module has printed its first line: it is running

    outcome: list[BaseException] = []

    def go() -> None:
        try:
            run_eval(plan, events=Events(), handle=handle)
        except BaseException as e:  # noqa: BLE001 - kept for the assertion below
            outcome.append(e)

    t = threading.Thread(target=go)
    t.start()
    assert started.wait(120)
    handle.interrupt()
    t.join(60)
    assert not t.is_alive()
    (error,) = outcome
    assert isinstance(error, UserError) and error.exit_code == ExitCode.INTERRUPTED, error
    record = read_eval(output, str(lora_run), plan.eval_id)
    assert record["state"] == "failed" and "interrupted" in record["error"]
