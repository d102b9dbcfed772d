"""Compute Engine prices, for the estimates `dtrain up` and `dtrain status` show.

These are list prices in USD for region us-central1 (Iowa), on-demand, as published on
https://cloud.google.com/compute/vm-instance-pricing (machine types),
https://cloud.google.com/compute/gpus-pricing (GPUs) and
https://cloud.google.com/compute/disks-image-pricing (persistent disk), as read for this table on
PRICES_AS_OF. Other regions differ (often by 5-20%), Spot prices change up to once a month, and
sustained-use or committed-use discounts are not applied: an estimate, labelled as one wherever
it is shown. The bill is the truth (Billing > Reports, filtered by the label dtrain-cluster).
"""

from __future__ import annotations

import dataclasses
import re

PRICES_AS_OF = "2025-06"
PRICES_REGION = "us-central1"
PRICES_SOURCE = "cloud.google.com/compute/vm-instance-pricing, /gpus-pricing, /disks-image-pricing"

# USD per hour, on demand. G2 prices include their L4 GPUs (the machine type fixes the count).
MACHINE_HOURLY = {
    "e2-medium": 0.033503,
    "e2-standard-2": 0.067006,
    "e2-standard-4": 0.134012,
    "n1-standard-1": 0.047500,
    "n1-standard-2": 0.095000,
    "n1-standard-4": 0.190000,
    "n1-standard-8": 0.380000,
    "n1-standard-16": 0.760000,
    "n1-standard-32": 1.520000,
    "g2-standard-4": 0.706832,
    "g2-standard-8": 0.853624,
    "g2-standard-12": 1.000416,
    "g2-standard-16": 1.147208,
    "g2-standard-24": 2.000833,
    "g2-standard-32": 1.734377,
    "g2-standard-48": 4.001665,
    "g2-standard-96": 8.003331,
}
# Spot prices move (up to once a month) with discounts of 60-91% off on demand; the estimate takes
# the smallest discount, so a Spot figure is an upper bound.
SPOT_FACTOR = 0.40
# Per GPU-hour for GPUs attached to N1 (G2's are in the machine price above).
GPU_HOURLY = {"nvidia-tesla-t4": 0.35}
DISK_GB_MONTH = 0.10  # pd-balanced
HOURS_PER_MONTH = 730


@dataclasses.dataclass(frozen=True)
class NodePrice:
    machine: float
    gpus: float
    disk: float
    known: bool  # False: the machine type or GPU is not in the table; the figure leaves it out

    @property
    def hourly(self) -> float:
        return self.machine + self.gpus + self.disk


def node_price(machine_type: str, accelerator: str, gpus: int, disk_gb: int, *, spot: bool) -> NodePrice:
    """The estimated hourly price of one node."""
    factor = SPOT_FACTOR if spot else 1.0
    machine = MACHINE_HOURLY.get(machine_type)
    known = machine is not None
    gpu_price = 0.0
    if gpus and not machine_type.startswith("g2-"):
        per = GPU_HOURLY.get(accelerator)
        known = known and per is not None
        gpu_price = (per or 0.0) * gpus * factor
    return NodePrice((machine or 0.0) * factor, gpu_price, disk_gb * DISK_GB_MONTH / HOURS_PER_MONTH, known)


_VCPU_RE = re.compile(r"-(?:standard|highmem|highcpu|megamem|ultramem|highgpu|ultragpu)-(\d+)[a-z]*$")
_SHARED_CORE = {"e2-micro": 2, "e2-small": 2, "e2-medium": 2, "f1-micro": 1, "g1-small": 1}


def vcpus(machine_type: str) -> int | None:
    """vCPUs of a predefined machine type, from its name (what the CPUS quota counts)."""
    if machine_type in _SHARED_CORE:
        return _SHARED_CORE[machine_type]
    m = _VCPU_RE.search(machine_type)
    return int(m.group(1)) if m else None


def estimate_note(spot: bool) -> str:
    kind = "Spot (60% off on-demand, the smallest Spot discount)" if spot else "on-demand"
    return f"estimate: {PRICES_REGION} {kind} list prices as of {PRICES_AS_OF} ({PRICES_SOURCE}); your bill may differ"
