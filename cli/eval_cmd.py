"""`dtrain eval`, `dtrain export` and `dtrain plot`: parse, call one function of dtrain.control.evals
or dtrain.control.plots, render what it returns. The torch side runs as `python -m dtrain.evaluate`,
started by the control layer; nothing here imports torch or matplotlib."""

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.evaluate import curves

Run = Annotated[str, typer.Argument(help="run id under --output, or the run's directory / gs:// URL")]
Checkpoint = Annotated[
    int | None,
    typer.Option("--checkpoint", metavar="STEP", help="a checkpoint's weights (default: the final model)"),
]
DataDir = Annotated[
    str,
    typer.Option("--data-dir", help="MNIST: the IDX files' directory, if not where the run found them"),
]


def eval_(
    run: Run,
    checkpoint: Checkpoint = None,
    prompts: Annotated[
        str, typer.Option("--prompts", help="LoRA: a file (or gs:// object) of prompts to continue, one a line")
    ] = "",
    data: Annotated[
        str,
        typer.Option(
            "--data",
            help="LoRA: held-out data in the run's format (text: its held-out share; instruction/chat: "
            "every record, loss on trained tokens); default: the run's own held-out set",
        ),
    ] = "",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="LoRA: tokens sampled per continuation (0: 48)")
    ] = 0,
    data_dir: DataDir = "",
    output: o.Output = None,
    cluster: o.Cluster = None,
    queue: Annotated[
        bool,
        typer.Option(
            "--queue", help="queue it as a one-node Slurm job on --cluster: print the job id and return at once"
        ),
    ] = False,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    as_json: o.Json = False,
) -> None:
    """Evaluate a run's final model (or a checkpoint): MNIST accuracy, per class and as a confusion matrix;
    LoRA held-out loss, perplexity and sampled continuations. The result is kept as eval/<id>.json."""
    from dtrain.control.evals import EvalRequest, evaluate

    where = _where(run, checkpoint, data_dir, output, cluster, accept_new_host_keys)
    request = EvalRequest(**where, prompts_file=prompts, data=data, max_new_tokens=max_new_tokens, queue=queue)
    if queue:
        _queue(request, as_json)
        return
    with console.operation() as (events, handle):
        record = evaluate(request, events=events if not as_json else _quiet(), handle=handle)
    if as_json:
        console.out.print_json(json.dumps(record))
        return
    headline, details = _view(record["workload"])(record)
    console.out.print(f"{record['run_id']} {record['model']}: {headline}", highlight=False)
    for item in details:
        console.out.print(item)
    console.out.print(f"kept as {record['run']}/eval/{record['id']}.json", highlight=False)


def _view(workload: str) -> Any:
    """How the terminal shows an evaluation of `workload`'s runs: its registry entry's eval_view, or a table of
    the figures (dtrain.cli.eval_views.figures)."""
    import importlib

    from dtrain.cli import eval_views
    from dtrain.control.workloads import WORKLOADS

    ref = WORKLOADS[workload].eval_view if workload in WORKLOADS else ""
    if not ref:
        return eval_views.figures
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _queue(request: Any, as_json: bool) -> None:
    """--queue: stdout carries the job id alone (for scripts), as `dtrain submit`'s; the rest goes to stderr."""
    import dataclasses

    from dtrain.control.evals import queue_eval
    from dtrain.control.events import Events

    events = Events(lambda ev: console.err.print(ev.message, markup=False, highlight=False) if ev.message else None)
    with console.operation() as (_terminal, handle):
        q = queue_eval(request, events=events, handle=handle)
    if as_json:
        print(json.dumps(dataclasses.asdict(q)), flush=True)
        return
    print(q.job_id, flush=True)
    console.err.print(
        f"job {q.job_id} ({q.workload}) queued on cluster {q.cluster}, partition {q.partition}: it evaluates run "
        f"{q.run_id} as {q.eval_id}, kept as {q.url}/eval/{q.eval_id}.json. Next: dtrain jobs --cluster {q.cluster}; "
        f"dtrain logs {q.job_id} -f --cluster {q.cluster}",
        highlight=False,
        markup=False,
    )


def _where(
    run: str, checkpoint: int | None, data_dir: str, output: str | None, cluster: str | None, accept: bool
) -> dict[str, Any]:
    """The fields of dtrain.control.evals.RunRequest, shared by eval and export."""
    return {
        "run": run,
        "checkpoint": checkpoint,
        "data_dir": data_dir,
        "output": output,
        "cluster": cluster,
        "config_path": console.state.config_path,
        "accept_new_host_keys": accept,
    }


def _quiet() -> Any:
    from dtrain.control.events import Events

    return Events()  # --json: the record alone on stdout


def export(
    run: Run,
    onnx: Annotated[bool, typer.Option("--onnx", help="export to ONNX (MNIST runs)")] = False,
    checkpoint: Checkpoint = None,
    to: Annotated[
        Path | None, typer.Option("-o", "--to", help="also copy the model to this file", show_default=False)
    ] = None,
    data_dir: DataDir = "",
    output: o.Output = None,
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    as_json: o.Json = False,
) -> None:
    """Export a run's model to ONNX under the run (final/model.onnx), checked against torch on its test
    split: the largest logit difference and whether every prediction is the same."""
    from dtrain.common.errors import UserError
    from dtrain.control.evals import ExportRequest
    from dtrain.control.evals import export as control_export

    if not onnx:
        raise UserError("name the format: dtrain export RUN --onnx (ONNX is the one there is)")
    where = _where(run, checkpoint, data_dir, output, cluster, accept_new_host_keys)
    request = ExportRequest(**where, copy_to=str(to) if to else "")
    with console.operation() as (events, handle):
        check = control_export(request, events=events if not as_json else _quiet(), handle=handle)
    if as_json:
        console.out.print_json(json.dumps(check))
        return
    same = "yes" if check["predictions_equal"] else f"no ({check['mismatched_predictions']} differ)"
    console.out.print(f"ONNX model (opset {check['opset']}): {check['path']}", highlight=False)
    if check.get("copied_to"):
        console.out.print(f"copied to {check['copied_to']}", highlight=False)
    console.out.print(
        f"checked against torch on {check['images']} images of {check['split']}: "
        f"max |logit difference| {check['max_abs_diff']:.3g}, predictions equal: {same}",
        highlight=False,
    )


def plot(
    runs: Annotated[list[str], typer.Argument(help="run ids under --output, or run directories / gs:// URLs")],
    to: Annotated[str, typer.Option("-o", "--out", help="the PNG to write (a path or gs:// URL)")] = "curves.png",
    width: Annotated[int, typer.Option("--width", help="pixels")] = curves.DEFAULT_WIDTH,
    height: Annotated[int, typer.Option("--height", help="pixels")] = curves.DEFAULT_HEIGHT,
    dpi: Annotated[
        int, typer.Option("--dpi", help="dots per inch (text size relative to the picture)")
    ] = curves.DEFAULT_DPI,
    smoothing: Annotated[
        float, typer.Option("--smoothing", help="exponential smoothing of the training loss, 0 (none) to <1")
    ] = curves.DEFAULT_SMOOTHING,
    output: o.Output = None,
) -> None:
    """Draw loss, accuracy or perplexity and learning rate against step for one or more runs, overlaid."""
    from dtrain.control.plots import PlotRequest
    from dtrain.control.plots import plot as control_plot

    request = PlotRequest(
        runs=runs,
        path=to,
        width=width,
        height=height,
        dpi=dpi,
        smoothing=smoothing,
        output=output,
        config_path=console.state.config_path,
    )
    with console.operation() as (events, _handle):
        result = control_plot(request, events=events)
    console.out.print(
        f"wrote {result.path} ({result.width}x{result.height}) for {', '.join(result.runs)}", highlight=False
    )
