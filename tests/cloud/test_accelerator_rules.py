"""The accelerators of infra/modules/plan/rules.json against the tables that must follow them: every
machine type the rules can derive is priced, its vCPUs are known (the quota check counts them), the
GPU has a quota metric for preflight, and packages/common/accelerators.py knows the card."""

from __future__ import annotations

import pytest

from dtrain.common import accelerators
from dtrain.control.gcp.preflight import ACCELERATOR_QUOTA
from dtrain.control.gcp.prices import GPU_HOURLY, MACHINE_HOURLY, node_price, vcpus
from dtrain.control.gcp.rules import rules

ACCELERATORS = rules()["accelerators"]


@pytest.mark.parametrize("name", sorted(ACCELERATORS))
def test_every_machine_type_the_rules_name_is_priced_with_its_vcpus(name):
    a = ACCELERATORS[name]
    machines = {**{m: int(c) for c, m in a["default_machine"].items()}, **a["fixed_counts"]}
    for machine, gpus in machines.items():
        price = node_price(machine, name, gpus, 100, spot=False)
        assert price.known and price.hourly > 0, machine
        assert vcpus(machine), machine
        if not a["fixed_counts"]:  # GPUs attached to N1: the machine is capped in vCPUs by the count
            assert vcpus(machine) <= a["max_vcpus"][str(gpus)], machine
            assert price.gpus == pytest.approx(gpus * GPU_HOURLY[name])
        else:  # the machine price includes its GPUs
            assert price.gpus == 0.0 and price.machine == MACHINE_HOURLY[machine]


def test_gpu_prices_scale_with_the_count_within_a_series():
    """A2/A3 prices per GPU are the same at every count (GPU, vCPUs, memory and SSD double together)."""
    for series, counts in (("a2-highgpu", (1, 2, 4, 8)), ("a2-ultragpu", (1, 2, 4, 8)), ("a3-highgpu", (1, 2, 4, 8))):
        per_gpu = {MACHINE_HOURLY[f"{series}-{n}g"] / n for n in counts}
        assert max(per_gpu) - min(per_gpu) < 1e-5, series
    # the published list prices (us-central1, on demand) these rows were read from
    assert MACHINE_HOURLY["a2-highgpu-1g"] == pytest.approx(3.673385)
    assert MACHINE_HOURLY["a3-highgpu-8g"] == pytest.approx(88.49)


@pytest.mark.parametrize(
    ("machine", "cpus"),
    [
        ("a2-highgpu-1g", 12),
        ("a2-megagpu-16g", 96),
        ("a2-ultragpu-8g", 96),
        ("a3-highgpu-8g", 208),
        ("a3-highgpu-2g", 52),
    ],
)
def test_vcpus_of_gpu_machine_types_are_not_their_gpu_count(machine, cpus):
    assert vcpus(machine) == cpus


@pytest.mark.parametrize("name", sorted(ACCELERATORS))
def test_preflight_knows_the_quota_metric(name):
    assert ACCELERATOR_QUOTA[name].startswith("NVIDIA_") and ACCELERATOR_QUOTA[name].endswith("_GPUS")


@pytest.mark.parametrize("name", sorted(ACCELERATORS))
def test_every_accelerator_has_a_card(name):
    card = accelerators.card(name)
    assert card.gcp == name
    assert 10 < card.usable_gib < card.capacity_gib <= 80
    assert card.peak(card.compute_precision) > 0


def test_spot_only_types_have_an_on_demand_alternative():
    for name, a in ACCELERATORS.items():
        for machine in a["spot_only"]:
            assert machine in a["default_machine"].values(), (name, machine)
        assert set(a["default_machine"].values()) - set(a["spot_only"]), name


def test_refused_accelerators_are_not_offered_and_say_why_in_one_line():
    refused = rules()["refused_accelerators"]
    assert "nvidia-tesla-v100" in refused  # sm_70: the GPU image's torch CUDA 13.0 build has no kernels for it
    for name, reason in refused.items():
        assert name not in ACCELERATORS, name
        assert reason and "\n" not in reason, name


def test_every_machine_type_the_rules_derive_takes_the_default_boot_disk():
    # infra/variables.tf's disk_type default, which `dtrain up` never overrides: every machine type the
    # rules can derive must take it, or a default cluster would fail at apply.
    import re

    from dtrain.control.assets import infra_dir
    from dtrain.control.gcp.rules import boot_disk_types

    variables = (infra_dir() / "variables.tf").read_text()
    default = re.search(r'variable "disk_type" \{[^}]*?default\s*=\s*"([^"]+)"', variables).group(1)
    for a in ACCELERATORS.values():
        for machine in {*a["default_machine"].values(), *a["fixed_counts"]}:
            allowed = boot_disk_types(machine)
            assert allowed is None or default in allowed, (machine, allowed)
    assert boot_disk_types("e2-medium") is None  # the CPU default takes every type


@pytest.mark.parametrize(
    ("machine", "pd_standard"),
    [
        ("g2-standard-8", False),
        ("a3-highgpu-8g", False),
        ("c3-standard-8", False),
        ("n1-standard-4", True),
        ("custom-4-15360", True),
        ("a2-highgpu-1g", True),
        ("e2-medium", True),
    ],
)
def test_boot_disk_types_by_series(machine, pd_standard):
    from dtrain.control.gcp.rules import boot_disk_types

    allowed = boot_disk_types(machine)
    assert (allowed is None or "pd-standard" in allowed) is pd_standard
