"""`dtrain build [--gpu] [--no-push]`: the training image, built and pushed (dtrain.control.images)."""

from pathlib import Path
from typing import Annotated

import typer

from dtrain.cli import console
from dtrain.cli import options as o


def build(
    gpu: Annotated[bool, typer.Option("--gpu", help="build Dockerfile.train.gpu (CUDA)")] = False,
    no_push: Annotated[bool, typer.Option("--no-push", help="build and tag locally only")] = False,
    registry: Annotated[
        str | None,
        typer.Option("--registry", help="push to HOST/PATH (default: the cluster's registry)", show_default=False),
    ] = None,
    cluster: o.Cluster = None,
    base_image: Annotated[
        str | None,
        typer.Option("--base-image", help="BASE_IMAGE build argument (e.g. one scripts/docker-base.sh made)"),
    ] = None,
    build_arg: Annotated[
        list[str] | None, typer.Option("--build-arg", help="NAME=VALUE for an ARG of the Dockerfile (repeatable)")
    ] = None,
    context: Annotated[
        Path | None, typer.Option("--context", help="the dtrain checkout to build (default: this one)")
    ] = None,
) -> None:
    """Build the training image (Docker), tag it with the git commit and a content hash, push it to the registry."""
    from dtrain.control.images import BuildRequest
    from dtrain.control.images import build as build_image

    request = BuildRequest(
        gpu=gpu,
        push=not no_push,
        registry=registry,
        cluster=cluster,
        config_path=console.state.config_path,
        base_image=base_image,
        build_args=tuple(build_arg or ()),
        context=context,
    )
    with console.operation() as (events, handle):
        result = build_image(request, events=events, handle=handle)
    if not result.pushed:
        console.out.print(
            f"not pushed (--no-push); run it locally with: docker run --rm {result.ref} --nproc-per-node=1 "
            "-m dtrain.mnist.train ...",
            highlight=False,
        )
    elif result.cluster_default:
        console.out.print(f"cluster {cluster} trains with it from now on: dtrain train mnist --cluster {cluster}")
    else:
        console.out.print(f"train with it: dtrain train mnist --cluster NAME --image {result.ref}", highlight=False)
