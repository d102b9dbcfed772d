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
    "n1-standard-64": 3.040000,
    # A2 and A3 machine types include their GPUs (and A2 Ultra / A3 High their bundled local SSD).
    # Read from the us-central1 "hour" figures of github.com/Cyclenerd/google-cloud-pricing-cost-calculator
    # pricing.yml (generated 2025-03-06 from Google's Cloud Billing Catalog API): a2-highgpu-1g 3.673385,
    # -2g 7.34677, a2-ultragpu-8g 40.550383, a3-highgpu-1g 11.061250; the other counts scale linearly
    # (GPU, vCPUs, memory and SSD all double with the count). a2-megagpu-16g: 16 A100 40GB at 2.933908
    # (gpus-pricing) plus its 96 vCPUs / 1360 GB at 8.79698 (SkyPilot's GCP catalog, vms.csv).
    "a2-highgpu-1g": 3.673385,
    "a2-highgpu-2g": 7.346770,
    "a2-highgpu-4g": 14.693540,
    "a2-highgpu-8g": 29.387080,
    "a2-megagpu-16g": 55.739508,
    "a2-ultragpu-1g": 5.068798,
    "a2-ultragpu-2g": 10.137596,
    "a2-ultragpu-4g": 20.275192,
    "a2-ultragpu-8g": 40.550383,
    "a3-highgpu-1g": 11.061250,  # Spot only (rules.json spot_only): the Spot figure is what is billed
    "a3-highgpu-2g": 22.122500,
    "a3-highgpu-4g": 44.245000,
    "a3-highgpu-8g": 88.490000,
}
# Machine series whose machine types come with their GPUs, priced in MACHINE_HOURLY (rules.json gives
# them fixed_counts); GPU_HOURLY is for GPUs attached to N1.
BUNDLED_GPU_SERIES = ("g2", "a2", "a3")
# Spot prices move (up to once a month) with discounts of 60-91% off on demand; the estimate takes
# the smallest discount, so a Spot figure is an upper bound.
SPOT_FACTOR = 0.40
# Per GPU-hour for GPUs attached to N1 (G2's, A2's and A3's are in the machine price above). V100:
# $2.48 in us-central1 on cloud.google.com/compute/gpus-pricing; the page itself was not in the stored
# sources this table was checked against (2025-06), the figure matches every third-party table that
# quotes it (Kubernetes' cluster-autoscaler GCE price model among them).
GPU_HOURLY = {"nvidia-tesla-t4": 0.35, "nvidia-tesla-v100": 2.48}
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
    if gpus and machine_type.split("-")[0] not in BUNDLED_GPU_SERIES:
        per = GPU_HOURLY.get(accelerator)
        known = known and per is not None
        gpu_price = (per or 0.0) * gpus * factor
    return NodePrice((machine or 0.0) * factor, gpu_price, disk_gb * DISK_GB_MONTH / HOURS_PER_MONTH, known)


_VCPU_RE = re.compile(r"-(?:standard|highmem|highcpu|megamem|ultramem|highgpu|ultragpu)-(\d+)[a-z]*$")
_SHARED_CORE = {"e2-micro": 2, "e2-small": 2, "e2-medium": 2, "f1-micro": 1, "g1-small": 1}


# A2/A3 names end in the GPU count ("-1g"), not the vCPUs: vCPUs per GPU, and a2-megagpu-16g's 96.
_VCPUS_PER_GPU = {"a2-highgpu": 12, "a2-ultragpu": 12, "a3-highgpu": 26}
_GPU_TYPE_RE = re.compile(r"^([a-z0-9]+-[a-z]+gpu)-(\d+)g$")


def vcpus(machine_type: str) -> int | None:
    """vCPUs of a predefined machine type, from its name (what the CPUS or <SERIES>_CPUS quota counts)."""
    if machine_type in _SHARED_CORE:
        return _SHARED_CORE[machine_type]
    if machine_type == "a2-megagpu-16g":
        return 96
    g = _GPU_TYPE_RE.match(machine_type)
    if g:
        per = _VCPUS_PER_GPU.get(g.group(1))
        return per * int(g.group(2)) if per else None
    m = _VCPU_RE.search(machine_type)
    return int(m.group(1)) if m else None


def estimate_note(spot: bool) -> str:
    kind = "Spot (60% off on-demand, the smallest Spot discount)" if spot else "on-demand"
    return f"estimate: {PRICES_REGION} {kind} list prices as of {PRICES_AS_OF} ({PRICES_SOURCE}); your bill may differ"
