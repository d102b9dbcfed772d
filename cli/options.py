"""Options shared by several commands, defined once. Each is spelled after its settings key
(--output is run.output), which is also how `dtrain config show` names a flag as a source. No
envvar= here: dtrain.control.settings reads DTRAIN_* itself, so the source of every value is known.
`dtrain train`'s options are generated from the workloads' config dataclasses (cli/train_cmd.py)."""

from typing import Annotated

import typer

Output = Annotated[
    str | None,
    typer.Option("--output", help="parent of runs/<run-id>/: a directory or gs://bucket/prefix", show_default=False),
]
Cluster = Annotated[
    str | None,
    typer.Option("--cluster", help="a [clusters.NAME] from dtrain.toml (default: this machine)", show_default=False),
]
Image = Annotated[
    str | None,
    typer.Option(
        "--image",
        help="run in this Docker image on every node of the cluster (see dtrain build; default: the cluster's image)",
        show_default=False,
    ),
]
Oversubscribe = Annotated[
    bool,
    typer.Option(
        "--oversubscribe",
        help="allow more processes per node than it has CPU cores (or GPUs), up to 4 per core",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="machine-readable output")]
AcceptNewHostKeys = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-keys",
        help="trust SSH host keys of nodes seen for the first time (a changed key is still refused)",
    ),
]
