"""The price table behind `dtrain up`'s estimate and `dtrain status`'s cost so far."""

from __future__ import annotations

import pytest

from dtrain.control.gcp.prices import (
    GPU_HOURLY,
    MACHINE_HOURLY,
    PRICES_AS_OF,
    PRICES_SOURCE,
    SPOT_FACTOR,
    estimate_note,
    node_price,
    vcpus,
)


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
    p = node_price("a4-highgpu-8g", "nvidia-b200", 8, 0, spot=False)  # not in the table
    assert not p.known
    assert p.machine == 0.0


@pytest.mark.parametrize(
    ("machine", "cpus"), [("e2-medium", 2), ("n1-standard-16", 16), ("g2-standard-48", 48), ("custom-thing", None)]
)
def test_vcpus_from_machine_type(machine, cpus):
    assert vcpus(machine) == cpus


def test_every_estimate_says_how_old_and_where_its_prices_are_from():
    """The note `up` and `status` print under each figure: the table's month (a real one, not in the
    future) and its sources."""
    import datetime

    as_of = datetime.datetime.strptime(PRICES_AS_OF, "%Y-%m")
    assert datetime.datetime(2024, 1, 1) <= as_of <= datetime.datetime.now()
    for spot in (False, True):
        note = estimate_note(spot)
        assert PRICES_AS_OF in note and PRICES_SOURCE in note and note.startswith("estimate: ")
    assert "Spot" in estimate_note(True) and "Spot" not in estimate_note(False)


def test_the_machine_types_dtrain_derives_are_all_priced():
    """Every machine type Terraform can pick by default (infra/modules/plan/rules.json, and e2-medium for
    CPU nodes) has a price, so the estimate before `up` is never partial for a default cluster."""
    from dtrain.control.gcp.rules import rules

    defaults = {"e2-medium"} | {m for a in rules()["accelerators"].values() for m in a["default_machine"].values()}
    for machine in sorted(defaults):
        accelerator = next(
            (n for n, a in rules()["accelerators"].items() if machine in a["default_machine"].values()), ""
        )
        gpus = next(
            (int(c) for a in rules()["accelerators"].values() for c, m in a["default_machine"].items() if m == machine),
            0,
        )
        assert node_price(machine, accelerator, gpus, 100, spot=False).known, machine


def test_up_estimate_prices_an_on_demand_master_among_spot_workers():
    """`dtrain up`'s plan: with spot = true the master is on-demand (master_spot = false), so it is
    priced at the list price and the workers at the Spot figure."""
    from dtrain.control.gcp.lifecycle import cost_plan
    from dtrain.control.gcp.spec import gcp_spec

    table = {"backend": "gcp", "workers": 2, "use_gpu": True, "spot": True, "disk_size_gb": 100}
    derived = {"machine_type": "g2-standard-8", "accelerator": "nvidia-l4", "gpus": 1}
    plan = cost_plan(gcp_spec("demo", table, "t"), derived, "proj-123456", "us-central1-a")
    disk = 100 * 0.10 / 730
    assert [(r.node, r.spot) for r in plan.rows] == [
        ("demo-master", False),
        ("demo-worker-0", True),
        ("demo-worker-1", True),
    ]
    assert plan.rows[0].usd_per_hour == pytest.approx(0.853624 + disk)
    assert plan.rows[1].usd_per_hour == pytest.approx(0.853624 * 0.40 + disk)
    both = cost_plan(gcp_spec("demo", {**table, "master_spot": True}, "t"), derived, "proj-123456", "us-central1-a")
    assert all(r.spot for r in both.rows) and both.rows[0].usd_per_hour == pytest.approx(0.853624 * 0.40 + disk)


def test_the_readmes_autostop_example_is_what_the_price_table_gives():
    """README's "What autostop saves": a master (on-demand) and two L4 Spot workers, g2-standard-8 with a
    100 GB disk, idle 14 h, without autostop and with autostop 60 m (then 13 h stopped: disks only)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    master = node_price("g2-standard-8", "nvidia-l4", 1, 100, spot=False)
    worker = node_price("g2-standard-8", "nvidia-l4", 1, 100, spot=True)
    running = master.hourly + 2 * worker.hourly
    stopped = 3 * master.disk
    without, with_autostop = 14 * running, 1 * running + 13 * stopped
    assert (round(running, 4), round(without, 4), round(with_autostop, 4)) == (1.5776, 22.0867, 2.1119)
    assert f"**${running:.4f}** | **${without:.4f}** | **${with_autostop:.4f}**" in readme
    assert f"Autostop saves ${without - with_autostop:.2f} of ${without:.2f} (90%)" in readme
    assert round(100 * (without - with_autostop) / without) == 90
    rows = [
        14 * master.hourly,
        master.hourly + 13 * master.disk,
        14 * 2 * worker.hourly,
        2 * worker.hourly + 13 * 2 * worker.disk,
    ]
    assert [f"${v:.4f}" in readme for v in rows] == [True] * 4, [round(v, 4) for v in rows]
