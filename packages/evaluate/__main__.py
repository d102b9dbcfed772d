"""`python -m dtrain.evaluate`: the torch side of `dtrain eval` and `dtrain export`, as a module with
flags, so the control layer runs it as a subprocess here, as a one-process job on a cluster's
master, and a batch script (Slurm) can run the same line.

    python -m dtrain.evaluate eval RUN [--checkpoint STEP] [--eval-id ID] [--prompt TEXT ...] [--prompts FILE]
    python -m dtrain.evaluate export RUN --onnx [--checkpoint STEP]

RUN is a run directory, a gs:// URL, or a run id under --output. Results are written under the run:
eval/<eval id>.json, final/model.onnx and its check (dtrain.evaluate.records). Exit codes are the
workloads': 0 done, 1 failure, 2 bad input (one `error:` line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.metrics import print_error
from dtrain.common.rundir import locate, read_json
from dtrain.common.storage import Store
from dtrain.evaluate import records


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtrain.evaluate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("run", help="run directory, gs:// URL, or run id under --output")
    common.add_argument("--output", default="runs", help="where run ids are looked up (default: runs)")
    common.add_argument(
        "--checkpoint", type=int, default=None, metavar="STEP", help="a checkpoint's weights (default: the final model)"
    )
    common.add_argument(
        "--data-dir", default="", help="MNIST: the IDX files' directory, if not where the run found them"
    )
    common.add_argument(
        "--split", default="", help="MNIST: the split to use instead of the run's eval split, e.g. test"
    )

    e = sub.add_parser("eval", parents=[common], help="evaluate a run's model; writes eval/<id>.json under the run")
    e.add_argument(
        "--evaluator",
        default="",
        help="the module that evaluates this workload's runs (its registry's "
        "`evaluate`, which dtrain eval passes; default: dtrain.evaluate.<the run's workload>)",
    )
    e.add_argument("--eval-id", default="", help="the record's id (default: a new one)")
    e.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N")
    e.add_argument(
        "--data",
        default="",
        help="LoRA: held-out data in the run's format (text: its held-out share; instruction/chat: "
        "every record, loss on trained tokens); default: the run's own held-out set",
    )
    e.add_argument("--prompt", action="append", default=[], help="LoRA: a prompt to continue (repeatable)")
    e.add_argument("--prompts", default="", help="LoRA: a file (or gs:// object) of prompts, one a line")
    e.add_argument("--max-new-tokens", type=int, default=0, help="LoRA: tokens sampled per continuation (0: 48)")

    x = sub.add_parser("export", parents=[common], help="export a run's model (ONNX), checked against torch")
    x.add_argument("--onnx", action="store_true", required=True, help="the format (ONNX is the one there is)")
    x.add_argument(
        "--exporter",
        required=True,
        help="the module that exports this workload's runs (its registry's `export`, which dtrain export passes)",
    )
    return p


def logged_figures(run: Store, step: int | None) -> dict[str, Any]:
    """What the run itself logged for these weights: its last eval line at `step` (the final step when
    None), so a reader sees both figures side by side."""
    from dtrain.evaluate.curves import read_metrics

    curves = read_metrics(run)
    if step is None:
        result = (read_json(run, "status.json") or {}).get("result") or {}
        step = result.get("steps")
    rows = [r for r in curves.rows if r.get("step") == step and any(k.startswith("eval_") for k in r)]
    return {k: v for k, v in rows[-1].items() if k.startswith("eval_") or k == "step"} if rows else {}


def _evaluator(name: str, run: Store, workload: str) -> Any:
    """The module that evaluates `workload`'s runs (it has evaluate_args); one line if there is none."""
    return _plugin(name, run, workload, "evaluator", "evaluate_args(run, saved, step, *, device, args, log)")


def _plugin(name: str, run: Store, workload: str, what: str, signature: str) -> Any:
    """The module `name` (a registry entry's evaluator or exporter), which must have `signature`'s function."""
    import importlib

    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise UserError(f"--{what} {name!r}: a module name, such as dtrain.evaluate.mnist")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):  # the module itself, not one of its imports
            raise UserError(f"run {run.url} is a {workload} run: no {what} {name} for it here") from None
        raise
    if not callable(getattr(module, signature.split("(")[0], None)):
        raise UserError(f"{name} has no {signature}: not an {what}")
    return module


def run_eval(args: argparse.Namespace, run: Store, saved: dict[str, Any]) -> dict[str, Any]:
    from dtrain.evaluate.loading import pick_device

    eval_id = args.eval_id or records.new_eval_id()
    records.eval_name(eval_id)  # refuse a malformed id before any work
    workload = saved["workload"]
    evaluator = _evaluator(args.evaluator or f"dtrain.evaluate.{workload}", run, workload)
    if args.checkpoint is not None:
        records.check_step(run, args.checkpoint)
    device = pick_device(args.device)
    started = time.time()
    planned = records.read_record(run, eval_id) or {}  # the starter's pending record, if it made one
    base = {
        "where": planned.get("where", socket.gethostname()),
        "run_id": saved.get("run_id", run.url.rstrip("/").rsplit("/", 1)[-1]),
        "run": run.url,
        "workload": workload,
        "step": args.checkpoint,
        "model": "final" if args.checkpoint is None else f"checkpoint step {args.checkpoint}",
        "host": socket.gethostname(),
        "device": str(device),
        "created": planned.get("created", started),
    }
    records.write_record(run, eval_id, {**base, "state": "running", "pid": os.getpid()})
    try:
        figures = evaluator.evaluate_args(run, saved, args.checkpoint, device=device, args=args, log=say)
    except BaseException as e:
        reason = "interrupted" if isinstance(e, KeyboardInterrupt) else (str(e) or type(e).__name__)
        records.write_record(run, eval_id, {**base, "state": "failed", "error": reason.splitlines()[0]})
        raise
    record = {
        **base,
        "state": "completed",
        "seconds": round(time.time() - started, 2),
        "metrics": figures,
        "logged": logged_figures(run, args.checkpoint),
    }
    records.write_record(run, eval_id, record)
    say(f"eval {eval_id} written to {run.join(records.eval_name(eval_id))}")
    return record


def run_export(args: argparse.Namespace, run: Store, saved: dict[str, Any]) -> dict[str, Any]:
    signature = "export(run, saved, step, *, data_dir, split, log)"
    exporter = _plugin(args.exporter, run, saved["workload"], "exporter", signature)
    if args.checkpoint is not None:
        records.check_step(run, args.checkpoint)
    check = exporter.export(run, saved, args.checkpoint, data_dir=args.data_dir, split=args.split, log=say)
    say(
        f"ONNX model written to {check['path']}: max |logit difference| from torch {check['max_abs_diff']:.3g} "
        f"on {check['images']} images, predictions equal: {'yes' if check['predictions_equal'] else 'no'}"
    )
    return check


def say(message: str) -> None:
    print(message, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    # transformers warns about its own renamed attributes when peft touches them (as in dtrain.lora.train).
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    args = parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (scancel of a queued evaluation, a stop from `dtrain eval`) ends it as Ctrl-C does: its
        # record says failed, interrupted, instead of running forever.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.checkpoint is not None and args.checkpoint < 0:
            raise UserError(f"--checkpoint {args.checkpoint}: a step is a whole number >= 0")
        run = locate(args.output, args.run)
        saved = records.run_config(run)
        if args.command == "eval":
            run_eval(args, run, saved)
        else:
            run_export(args, run, saved)
    except UserError as e:
        print_error(str(e))
        return int(e.exit_code)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except Exception:  # noqa: BLE001 - a failure, with its traceback for the log
        traceback.print_exc()
        return int(ExitCode.FAILURE)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
