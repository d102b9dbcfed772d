"""`dtrain train <workload>`: resolve settings, pick the cluster, launch, report."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import UserError
from dtrain.mnist.config import Dataset

app = typer.Typer(help="Train a workload on this machine or a cluster.", no_args_is_help=True)


@app.command("mnist")
def mnist(
    dataset: Annotated[Dataset | None, typer.Option("--dataset", help="which IDX dataset", show_default=False)] = None,
    data_dir: o.DataDir = None,
    epochs: Annotated[int | None, typer.Option("--epochs", help="passes over the data", show_default=False)] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", help="global batch size", show_default=False)
    ] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="peak learning rate", show_default=False)] = None,
    train_split: Annotated[
        str | None, typer.Option("--train-split", help="e.g. train, test[:8000]", show_default=False)
    ] = None,
    eval_split: Annotated[
        str | None, typer.Option("--eval-split", help="e.g. test, test[8000:]", show_default=False)
    ] = None,
    augment: Annotated[
        bool | None, typer.Option("--augment/--no-augment", help="random 2-pixel shifts", show_default=False)
    ] = None,
    download: Annotated[
        bool | None,
        typer.Option("--download/--no-download", help="fetch from the public mirrors if not found", show_default=False),
    ] = None,
    nproc: o.Nproc = None,
    output: o.Output = None,
    cluster: o.Cluster = None,
    resume: o.Resume = None,
    run_id: o.RunId = None,
    precision: o.PrecisionOpt = None,
    backend: o.BackendOpt = None,
    seed: o.Seed = None,
    checkpoint_every: o.CheckpointEvery = None,
    max_restarts: o.MaxRestarts = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    image: o.Image = None,
) -> None:
    """Train a CNN on MNIST or Fashion-MNIST (IDX files), with DDP and resumable checkpoints."""
    flags = {
        "mnist.dataset": dataset,
        "mnist.data_dir": str(data_dir) if data_dir else None,
        "mnist.epochs": epochs,
        "mnist.batch_size": batch_size,
        "mnist.lr": lr,
        "mnist.train_split": train_split,
        "mnist.eval_split": eval_split,
        "mnist.augment": augment,
        "mnist.download": download,
        **o.common_flags(
            nproc=nproc,
            output=output,
            cluster=cluster,
            resume=resume,
            run_id=run_id,
            precision=precision,
            backend=backend,
            seed=seed,
            checkpoint_every=checkpoint_every,
            max_restarts=max_restarts,
        ),
    }
    console.state.exit_code = launch("mnist", flags, accept_new_host_keys=accept_new_host_keys, image=image)


@app.command("lora")
def lora(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="hub id, local directory, or preset: tiny-llama, tiny-gpt2, qwen2.5-0.5b-shape",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option("--data", help="text/JSONL file or directory, gs:// URL, or dataset name", show_default=False),
    ] = None,
    text_field: Annotated[
        str | None, typer.Option("--text-field", help="JSONL field holding the text", show_default=False)
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="optimizer steps (default: --epochs passes)", show_default=False)
    ] = None,
    epochs: Annotated[
        int | None,
        typer.Option("--epochs", help="passes over the data when --max-steps is not set", show_default=False),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="tokens per packed block", show_default=False)
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", help="global blocks per optimizer step", show_default=False)
    ] = None,
    grad_accum: Annotated[
        int | None, typer.Option("--grad-accum", help="micro-batches per optimizer step", show_default=False)
    ] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="peak learning rate", show_default=False)] = None,
    lora_r: Annotated[int | None, typer.Option("--lora-r", help="LoRA rank", show_default=False)] = None,
    lora_alpha: Annotated[
        float | None, typer.Option("--lora-alpha", help="LoRA alpha (scale = alpha / r)", show_default=False)
    ] = None,
    lora_dropout: Annotated[
        float | None, typer.Option("--lora-dropout", help="dropout on the LoRA input", show_default=False)
    ] = None,
    target_modules: Annotated[
        str | None,
        typer.Option(
            "--target-modules", help="comma-separated layer names (default: attention + MLP)", show_default=False
        ),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option("--eval-every", help="evaluate every N steps (default: at the end)", show_default=False),
    ] = None,
    merge: Annotated[
        bool | None,
        typer.Option("--merge/--no-merge", help="also write the merged model to final/merged", show_default=False),
    ] = None,
    nproc: o.Nproc = None,
    output: o.Output = None,
    cluster: o.Cluster = None,
    resume: o.Resume = None,
    run_id: o.RunId = None,
    precision: o.PrecisionOpt = None,
    backend: o.BackendOpt = None,
    seed: o.Seed = None,
    checkpoint_every: o.CheckpointEvery = None,
    max_restarts: o.MaxRestarts = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    image: o.Image = None,
) -> None:
    """LoRA fine-tuning of a causal LM (transformers + peft); the adapter lands in final/adapter."""
    flags = {
        "lora.model": model,
        "lora.data": data,
        "lora.text_field": text_field,
        "lora.max_steps": max_steps,
        "lora.epochs": epochs,
        "lora.seq_len": seq_len,
        "lora.batch_size": batch_size,
        "lora.grad_accum": grad_accum,
        "lora.lr": lr,
        "lora.lora_r": lora_r,
        "lora.lora_alpha": lora_alpha,
        "lora.lora_dropout": lora_dropout,
        "lora.target_modules": [t.strip() for t in target_modules.split(",") if t.strip()] if target_modules else None,
        "lora.eval_every": eval_every,
        "lora.merge": merge,
        **o.common_flags(
            nproc=nproc,
            output=output,
            cluster=cluster,
            resume=resume,
            run_id=run_id,
            precision=precision,
            backend=backend,
            seed=seed,
            checkpoint_every=checkpoint_every,
            max_restarts=max_restarts,
        ),
    }
    console.state.exit_code = launch("lora", flags, accept_new_host_keys=accept_new_host_keys, image=image)


def launch(
    workload: str, flags: dict[str, Any], *, accept_new_host_keys: bool = False, image: str | None = None
) -> int:
    """Resolve the settings and run `workload` where they say; returns the job's exit code. `image`:
    run in that Docker image on every node of the cluster (container mode)."""
    from dtrain.cli.launcher import plan_local, run_local
    from dtrain.cli.settings import DEFAULT, ClusterBackend, get_cluster, load_settings
    from dtrain.common.rundir import locate, read_json

    settings = load_settings(console.state.config_path, flags)
    cluster_cfg = get_cluster(settings)
    cluster = None
    output = settings.run.output
    if cluster_cfg.backend != ClusterBackend.LOCAL:
        from dtrain.cli.cluster import resolve

        cluster = resolve(cluster_cfg)
        if cluster.needs_image and not (image or cluster.image):
            raise UserError(
                f"cluster {cluster.name!r} has no training image: run dtrain build --cluster {cluster.name} (it "
                f'builds and pushes to the cluster\'s registry), or set image = "..." in [clusters.{cluster.name}], '
                "or pass --image"
            )
        if cluster.default_output and settings.source("run.output") == DEFAULT:
            output = cluster.default_output  # a gcp cluster's runs go to its bucket
    resumed = None
    if settings.run.resume:
        # The run's own config sits beneath the file, environment and flags.
        resumed = locate(output, settings.run.resume)
        saved = read_json(resumed, "config.json") or {}
        if saved.get("workload", workload) != workload:
            raise UserError(f"run {resumed.url} is a {saved['workload']} run: use `dtrain train {saved['workload']}`")
        flat = saved.get("config") or {}
        settings = load_settings(console.state.config_path, flags, saved=(f"{resumed.url}/config.json", workload, flat))
    settings.workload(workload)  # validate the whole workload config before starting anything
    if cluster is not None:
        from dtrain.cli.remote import launch_cluster

        code, run, run_id = launch_cluster(
            workload,
            settings.explicit(workload),
            cluster=cluster,
            nproc=settings.launch.nproc,
            max_restarts=settings.launch.max_restarts,
            output=output,
            resumed=resumed,
            accept_new_host_keys=accept_new_host_keys,
            image=image or "",
        )
        _report(workload, run.url, run_id, code)
        return code
    if image:
        raise UserError(
            "--image runs the job in containers on a cluster's nodes: add --cluster NAME (a hosts or gcp cluster); "
            "on this machine use `docker compose --profile cpu up` or docker run (see compose.yaml)"
        )
    plan = plan_local(
        workload,
        settings.explicit(workload),
        nproc=settings.launch.nproc,
        max_restarts=settings.launch.max_restarts,
        output=settings.run.output,
        resumed=resumed,
    )
    verb = "resuming" if plan.resuming else "starting"
    console.out.print(
        f"{verb} [bold]{workload}[/] run [cyan]{plan.run_id}[/] on this machine: "
        f"{plan.nproc} process(es) x {plan.threads} thread(s)",
        highlight=False,
    )
    code = run_local(plan)
    _report(workload, plan.run.url, plan.run_id, code)
    return code


def _report(workload: str, url: str, run_id: str, code: int) -> None:
    from dtrain.common.errors import ExitCode

    if code == ExitCode.OK:
        console.out.print(
            f"run [cyan]{run_id}[/] completed: {url} (config.json, metrics.jsonl, checkpoints/, final/)",
            highlight=False,
        )
    elif code == ExitCode.PREEMPTED:
        console.err.print(
            f"run {run_id} stopped after a checkpoint: resume with `dtrain train {workload} --resume {run_id}`",
            highlight=False,
        )
    elif code == ExitCode.INTERRUPTED:
        console.err.print(
            f"run {run_id} interrupted: `dtrain train {workload} --resume {run_id}` continues from its last checkpoint",
            highlight=False,
        )
    elif code != ExitCode.USAGE:
        console.err.print(
            f"run {run_id} failed (exit {code}); logs above. `dtrain train {workload} --resume "
            f"{run_id}` continues from its last complete checkpoint",
            highlight=False,
        )
