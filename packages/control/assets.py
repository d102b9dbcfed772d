"""Files dtrain needs besides its Python code: the Terraform configuration (infra/) and the image
build context (the Dockerfiles, docker/). They are found in the checkout dtrain runs from, or where
DTRAIN_INFRA_DIR points."""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.common.errors import UserError


def source_root() -> Path:
    """The checkout this package runs from (packages/control/ is two levels below it)."""
    return Path(__file__).resolve().parents[2]


def infra_dir() -> Path:
    """The Terraform configuration: infra/ of this checkout (or DTRAIN_INFRA_DIR, read by settings)."""
    override = os.environ.get("DTRAIN_INFRA_DIR")
    path = Path(override) if override else source_root() / "infra"
    if not (path / "versions.tf").is_file():
        raise UserError(
            f"Terraform configuration not found at {path}: run dtrain from a clone of the repository "
            "(pip install -e .), or set DTRAIN_INFRA_DIR to its infra/ directory"
        )
    return path
