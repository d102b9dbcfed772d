"""Files dtrain needs besides its Python code: the Terraform configuration (infra/) and the training
image's build context (the Dockerfiles, .dockerignore, docker/'s build files and the workloads' code).

In a checkout (`pip install -e .`, or running from the source tree) they are the checkout's own. An
installed wheel carries them as the package data of `dtrain.bundle`, a package whose directory is the
checkout's root and whose only content is those files (pyproject.toml lists them), so the paths inside
are the checkout's: dtrain/bundle/infra/main.tf is infra/main.tf. DTRAIN_INFRA_DIR (read by settings)
names another infra/.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from dtrain.common.errors import UserError

BUNDLE = "dtrain.bundle"
# The build context's parts besides the workloads' code (what .dockerignore lets in; the Dockerfiles).
BUILD_FILES = ("Dockerfile.train", "Dockerfile.train.gpu", ".dockerignore", "docker")


def image_packages() -> dict[str, str]:
    """The packages the training images hold, by their path in the build context: dtrain.common and each
    built-in's own (the registry, workloads.WORKLOADS). The Dockerfiles copy packages/ as a whole and
    .dockerignore keeps dtrain's CLI-side packages out, so a checkout's context holds the same ones."""
    from dtrain.control.workloads import builtin_packages  # here: `dtrain up` reads infra_dir without it

    return {f"packages/{name}": f"dtrain.{name}" for name in ["common", *builtin_packages()]}


def source_root() -> Path:
    """The checkout this package runs from (packages/control/ is two levels below it); in an installed
    wheel, a directory that is no checkout."""
    return Path(__file__).resolve().parents[2]


def bundle_root() -> Path | None:
    """Where the installed `dtrain.bundle` package data is, or None (an editable install made before
    the bundle existed: the checkout has everything)."""
    spec = importlib.util.find_spec(BUNDLE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def infra_dir() -> Path:
    """The Terraform configuration: DTRAIN_INFRA_DIR, else this checkout's infra/, else the one the
    installed wheel carries."""
    override = os.environ.get("DTRAIN_INFRA_DIR")
    if override:
        candidates = [Path(override)]
    else:
        bundle = bundle_root()
        candidates = [source_root() / "infra", *([bundle / "infra"] if bundle else [])]
    for path in candidates:
        if (path / "versions.tf").is_file():
            return path
    raise UserError(
        f"Terraform configuration not found at {candidates[0]}: reinstall dtrain (pip install 'dtrain[gcp]'), "
        "or set DTRAIN_INFRA_DIR to an infra/ directory"
    )


def build_context() -> Path:
    """The directory to build the training images from: this checkout, else (an installed wheel) a copy
    assembled from the bundle's build files and the installed workloads' code, laid out as in the
    checkout, under the cache directory."""
    root = source_root()
    if (root / "Dockerfile.train").is_file():
        return root
    bundle = bundle_root()
    if bundle is None or not (bundle / "Dockerfile.train").is_file():
        return root  # nothing to build from here (images.find_context then looks elsewhere)
    from dtrain.common.env import cache_dir

    context = cache_dir() / "build-context"
    # Assembled afresh each time: the installed code may have changed since the last build.
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    for name in BUILD_FILES:
        source = bundle / name
        if source.is_dir():
            shutil.copytree(source, context / name)
        elif source.is_file():
            shutil.copy2(source, context / name)
    for relative, package in image_packages().items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"{package} is not installed, so its code cannot go into the image: reinstall dtrain")
        shutil.copytree(
            spec.submodule_search_locations[0],
            context / relative,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    return context
