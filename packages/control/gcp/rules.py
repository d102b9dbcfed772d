"""dtrain's GCP rules, read from the one file Terraform reads too (infra/modules/plan/rules.json):
the accelerators and how each attaches to a VM, the default accelerator, and the limits on a
cluster's name, worker count and disk size. Nothing here restates a number."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from dtrain.control.assets import infra_dir


@functools.cache
def rules() -> dict[str, Any]:
    return json.loads((infra_dir() / "modules" / "plan" / "rules.json").read_text())


def accelerators() -> list[str]:
    return list(rules()["accelerators"])


def default_accelerator() -> str:
    return rules()["default_accelerator"]


def limits(name: str) -> tuple[int, int]:
    """(min, max) of worker_count or disk_size_gb."""
    r = rules()[name]
    return r["min"], r["max"]


def cluster_name_ok(name: str) -> bool:
    return re.fullmatch(rules()["cluster_name"]["pattern"], name) is not None


def cluster_name_rule() -> str:
    r = rules()["cluster_name"]
    return (
        f"{r['min_length']}-{r['max_length']} lowercase letters, digits or '-', starting with a letter and not "
        "ending with '-'"
    )


def refused_accelerator(name: str) -> str | None:
    """The one-line reason dtrain refuses accelerator `name` (rules.json's refused_accelerators: a card
    GCP offers that dtrain's GPU image cannot run), or None."""
    return rules().get("refused_accelerators", {}).get(name)


def machine_family(machine_type: str) -> str:
    """The series of a machine type, as the plan module derives it: legacy custom types are N1."""
    return "n1" if machine_type.startswith("custom-") else machine_type.split("-")[0]


def boot_disk_types(machine_type: str) -> list[str] | None:
    """The Persistent Disk types `machine_type` takes as a boot disk (rules.json's boot_disk_types),
    or None where its series takes every type dtrain offers."""
    return rules().get("boot_disk_types", {}).get(machine_family(machine_type))
