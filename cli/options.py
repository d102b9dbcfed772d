"""Options shared by several commands, defined once. Each is spelled after its settings key
(--data-dir is mnist.data_dir), which is also how `dtrain config show` names a flag as a source.
No envvar= here: cli/settings.py reads DTRAIN_* itself, so the source of every value is known."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dtrain.common.config import Backend, Precision

Nproc = Annotated[int | None, typer.Option("--nproc", help="processes per node (default: auto)", show_default=False)]
Output = Annotated[
    str | None,
    typer.Option("--output", help="parent of runs/<run-id>/: a directory or gs://bucket/prefix", show_default=False),
]
Cluster = Annotated[
    str | None,
    typer.Option("--cluster", help="a \\[clusters.NAME] from dtrain.toml (default: this machine)", show_default=False),
]
RunId = Annotated[
    str | None, typer.Option("--run-id", help="name the run (default: <workload>-<utc time>-<hex>)", show_default=False)
]
Resume = Annotated[
    str | None,
    typer.Option("--resume", help="continue RUN (an id under --output, or its directory/URL)", show_default=False),
]
PrecisionOpt = Annotated[
    Precision | None,
    typer.Option("--precision", help="auto: bf16 on GPUs with it, fp16 on older GPUs, fp32 on CPU", show_default=False),
]
BackendOpt = Annotated[
    Backend | None, typer.Option("--backend", help="auto: nccl with CUDA, gloo without", show_default=False)
]
Seed = Annotated[int | None, typer.Option("--seed", help="seed for weights and data order", show_default=False)]
CheckpointEvery = Annotated[
    int | None, typer.Option("--checkpoint-every", help="also checkpoint every N steps", show_default=False)
]
MaxRestarts = Annotated[
    int | None, typer.Option("--max-restarts", help="torchrun restarts of failed workers", show_default=False)
]
Image = Annotated[
    str | None,
    typer.Option(
        "--image",
        help="run in this Docker image on every node of the cluster (see dtrain build; default: the cluster's image)",
        show_default=False,
    ),
]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="directory with the data files", show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def common_flags(
    *,
    run_id: str | None,
    nproc: int | None,
    output: str | None,
    cluster: str | None,
    resume: str | None,
    precision: Precision | None,
    backend: Backend | None,
    seed: int | None,
    checkpoint_every: int | None,
    max_restarts: int | None,
) -> dict[str, object]:
    """The run.* part of a train command's flags, as settings keys."""
    return {
        "run.nproc": nproc,
        "run.output": output,
        "run.cluster": cluster,
        "run.resume": resume,
        "run.run_id": run_id,
        "run.precision": precision,
        "run.backend": backend,
        "run.seed": seed,
        "run.checkpoint_every": checkpoint_every,
        "run.max_restarts": max_restarts,
    }


AcceptNewHostKeys = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-keys",
        help="trust SSH host keys of nodes seen for the first time (a changed key is still refused)",
    ),
]
