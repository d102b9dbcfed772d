"""The price table behind `dtrain up`'s estimate and `dtrain status`'s cost so far."""

from __future__ import annotations

import pytest

from dtrain.cli.prices import GPU_HOURLY, MACHINE_HOURLY, PRICES_AS_OF, SPOT_FACTOR, node_price, vcpus


def test_t4_node_adds_gpu_price_to_n1_machine():
    p = node_price("n1-standard-4", "nvidia-tesla-t4", 2, 100, spot=False)
    assert p.known
    assert p.machine == MACHINE_HOURLY["n1-standard-4"]
    assert p.gpus == pytest.approx(2 * GPU_HOURLY["nvidia-tesla-t4"])
    assert p.disk == pytest.approx(100 * 0.10 / 730)
    assert p.hourly == pytest.approx(p.machine + p.gpus + p.disk)


def test_g2_price_includes_its_l4s_and_spot_is_discounted():
    on = node_price("g2-standard-8", "nvidia-l4", 1, 0, spot=False)
    spot = node_price("g2-standard-8", "nvidia-l4", 1, 0, spot=True)
    assert on.gpus == 0.0  # the machine price includes the GPU
    assert spot.hourly == pytest.approx(on.hourly * SPOT_FACTOR)


def test_unknown_machine_is_flagged_not_guessed():
    p = node_price("a3-highgpu-8g", "nvidia-h100-80gb", 8, 0, spot=False)
    assert not p.known
    assert p.machine == 0.0


@pytest.mark.parametrize(
    ("machine", "cpus"), [("e2-medium", 2), ("n1-standard-16", 16), ("g2-standard-48", 48), ("custom-thing", None)]
)
def test_vcpus_from_machine_type(machine, cpus):
    assert vcpus(machine) == cpus


def test_table_is_dated():
    assert PRICES_AS_OF
