"""node_states: the cluster's VMs, their status, and preemption as Compute Engine records it."""

from __future__ import annotations

import datetime as dt

from dtrain.control.gcp.vmstates import node_states

from .conftest import REGION

ZONE = f"{REGION}-a"
LABELS = {"dtrain-cluster": "demo"}
NOW = dt.datetime(2025, 1, 1, 12, 0, tzinfo=dt.timezone.utc)


def test_running_cluster(gcp, world):
    world.add_instance(
        ZONE,
        "demo-master",
        labels=LABELS,
        accelerator="nvidia-l4",
        gpus=1,
        internal_ip="10.0.0.2",
        external_ip="34.1.2.3",
        created="2025-01-01T03:00:00.000-08:00",
        last_start="2025-01-01T03:30:00.000-08:00",
    )
    world.add_instance(
        ZONE,
        "demo-worker-0",
        labels=LABELS,
        accelerator="nvidia-l4",
        gpus=2,
        machine_type="g2-standard-24",
        internal_ip="10.0.0.3",
        external_ip="34.1.2.4",
    )
    states = node_states(gcp, ZONE, "demo", now=NOW)
    assert [s.name for s in states] == ["demo-master", "demo-worker-0"]
    master, worker = states
    assert (master.status, master.machine_type, master.gpus, master.accelerator) == (
        "RUNNING",
        "g2-standard-8",
        1,
        "nvidia-l4",
    )
    assert (master.internal_ip, master.external_ip) == ("10.0.0.2", "34.1.2.3")
    assert master.uptime_s == 30 * 60  # 11:30Z -> 12:00Z
    assert master.created == "2025-01-01T03:00:00.000-08:00"
    assert (worker.machine_type, worker.gpus, worker.spot, worker.preempted) == ("g2-standard-24", 2, False, False)
    # No spot VM: the zone's operations are not read.
    assert world.called("GET", "/operations$") == 0


def test_label_is_what_counts(gcp, world):
    world.add_instance(ZONE, "demo-master", labels=LABELS)
    world.add_instance(ZONE, "demo-2-master", labels={"dtrain-cluster": "demo-2"})
    world.add_instance(ZONE, "demo-unlabelled")
    world.add_instance(f"{REGION}-b", "demo-elsewhere", labels=LABELS)
    assert [s.name for s in node_states(gcp, ZONE, "demo")] == ["demo-master"]
    (_, path, query), *_ = [r for r in world.requests if r[1].endswith("/instances")]
    assert query["filter"] == ['labels.dtrain-cluster = "demo"']


def test_preempted_spot_node(gcp, world):
    world.add_instance(ZONE, "demo-master", labels=LABELS)
    world.add_instance(ZONE, "demo-worker-0", labels=LABELS, spot=True, last_start="2025-01-01T01:00:00.000-08:00")
    world.add_instance(ZONE, "demo-worker-1", labels=LABELS, spot=True, last_start="2025-01-01T01:00:00.000-08:00")
    world.add_instance(ZONE, "demo-worker-2", labels=LABELS, spot=True, last_start="2025-01-01T01:00:00.000-08:00")
    # worker-0: preempted and still down. worker-1: preempted, then started again. worker-2: stopped
    # by someone (TERMINATED, no preemption recorded).
    world.preempt(ZONE, "demo-worker-0", "2025-01-01T02:00:00.000-08:00")
    world.preempt(ZONE, "demo-worker-1", "2025-01-01T02:00:00.000-08:00")
    world.instances[(ZONE, "demo-worker-1")].update(
        status="RUNNING", lastStartTimestamp="2025-01-01T02:10:00.000-08:00"
    )
    world.instances[(ZONE, "demo-worker-2")]["status"] = "TERMINATED"
    # A preemption of another cluster's VM in the same zone is not ours.
    world.add_instance(ZONE, "other-0", labels={"dtrain-cluster": "other"}, spot=True)
    world.preempt(ZONE, "other-0", "2025-01-01T02:00:00.000-08:00")

    by_name = {s.name: s for s in node_states(gcp, ZONE, "demo", now=NOW)}
    assert set(by_name) == {"demo-master", "demo-worker-0", "demo-worker-1", "demo-worker-2"}
    w0, w1, w2 = by_name["demo-worker-0"], by_name["demo-worker-1"], by_name["demo-worker-2"]
    assert (w0.status, w0.spot, w0.preempted, w0.preempted_at) == (
        "TERMINATED",
        True,
        True,
        "2025-01-01T02:00:00.000-08:00",
    )
    assert w0.uptime_s is None
    assert (w1.status, w1.preempted) == ("RUNNING", False)
    assert w1.uptime_s == (NOW - dt.datetime(2025, 1, 1, 10, 10, tzinfo=dt.timezone.utc)).total_seconds()
    assert (w2.status, w2.spot, w2.preempted) == ("TERMINATED", True, False)
    assert by_name["demo-master"].preempted is False
    ops = [q for m, p, q in world.requests if p.endswith(f"/zones/{ZONE}/operations")]
    assert ops and ops[0]["filter"] == ['operationType = "compute.instances.preempted"']


def test_expected_node_that_is_gone(gcp, world):
    """A spot VM whose termination action is DELETE disappears; the record still names it."""
    world.add_instance(ZONE, "demo-master", labels=LABELS)
    world.add_instance(ZONE, "demo-worker-0", labels=LABELS, spot=True)
    world.preempt(ZONE, "demo-worker-0", "2025-01-01T02:00:00.000-08:00")
    del world.instances[(ZONE, "demo-worker-0")]
    states = node_states(gcp, ZONE, "demo", expected=["demo-master", "demo-worker-0", "demo-worker-1"])
    by_name = {s.name: s for s in states}
    assert by_name["demo-worker-0"].status == "MISSING" and by_name["demo-worker-0"].preempted
    assert by_name["demo-worker-1"].status == "MISSING" and not by_name["demo-worker-1"].preempted


def test_many_nodes_are_paged(gcp, world):
    for i in range(7):
        world.add_instance(ZONE, f"demo-worker-{i}", labels=LABELS)
    assert len(node_states(gcp, ZONE, "demo")) == 7
    assert world.called("GET", f"/zones/{ZONE}/instances$") == 4  # pages of 2


def test_run_time_since_the_last_start_to_now_or_to_the_stop(gcp, world):
    """run_s, what `dtrain status` prices: a running VM's time since its last start (its creation when
    Compute has no lastStartTimestamp), a stopped VM's from its last start to its last stop."""
    world.add_instance(ZONE, "demo-master", labels=LABELS, created="2025-01-01T02:00:00.000-08:00", last_start=None)
    world.add_instance(ZONE, "demo-worker-0", labels=LABELS, spot=True, last_start="2025-01-01T01:00:00.000-08:00")
    world.preempt(ZONE, "demo-worker-0", "2025-01-01T02:30:00.000-08:00")
    by_name = {s.name: s for s in node_states(gcp, ZONE, "demo", now=NOW)}
    master, worker = by_name["demo-master"], by_name["demo-worker-0"]
    assert (master.uptime_s, master.run_s) == (2 * 3600, 2 * 3600)  # 10:00Z (created) -> 12:00Z
    assert worker.uptime_s is None and worker.run_s == 90 * 60  # 09:00Z -> 10:30Z, then stopped
    assert worker.last_stop == "2025-01-01T02:30:00.000-08:00"


def test_status_cost_so_far_from_known_timestamps_and_prices(gcp, world, server, tmp_path, monkeypatch):
    """`dtrain status`'s figures: a 1 master + 2 L4 Spot worker cluster, the master on-demand. Each node's
    hours since its last start x its hourly price (prices.py), and the total."""
    from dtrain.control.gcp import lifecycle
    from dtrain.control.settings import ClusterConfig

    monkeypatch.setenv("DTRAIN_GCP_COMPUTE_ENDPOINT", server.endpoint)
    monkeypatch.setenv("DTRAIN_GCP_API_ENDPOINT", server.endpoint)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no record of the cluster here
    world.add_instance(ZONE, "demo-master", labels=LABELS, accelerator="nvidia-l4", gpus=1,
                       last_start="2025-01-01T01:00:00.000-08:00")  # fmt: skip
    world.add_instance(ZONE, "demo-worker-0", labels=LABELS, accelerator="nvidia-l4", gpus=1, spot=True,
                       last_start="2025-01-01T02:30:00.000-08:00")  # fmt: skip
    world.add_instance(ZONE, "demo-worker-1", labels=LABELS, accelerator="nvidia-l4", gpus=1, spot=True,
                       last_start="2025-01-01T01:00:00.000-08:00")  # fmt: skip
    world.instances[(ZONE, "demo-worker-1")].update(
        status="TERMINATED", lastStopTimestamp="2025-01-01T03:00:00.000-08:00"
    )
    table = {"backend": "gcp", "project": "dtrain-test", "zone": ZONE, "workers": 2, "use_gpu": True, "spot": True}
    st = lifecycle.status(ClusterConfig(backend="gcp", name="demo", spec=table), now=NOW)

    g2 = 0.853624  # g2-standard-8 (1 L4), us-central1 on-demand, per hour; Spot is 0.40 of it
    disk = 100 * 0.10 / 730  # 100 GB pd-balanced
    rows = {r.name: r for r in st.nodes}
    master, w0, w1 = rows["demo-master"], rows["demo-worker-0"], rows["demo-worker-1"]
    assert (master.state, master.spot, master.node_hours) == ("RUNNING", False, 3.0)  # 09:00Z -> 12:00Z
    assert master.usd_so_far == round(3.0 * (g2 + disk), 4) == 2.6020
    assert (w0.state, w0.spot, w0.node_hours) == ("RUNNING", True, 1.5)  # 10:30Z -> 12:00Z
    assert w0.usd_so_far == round(1.5 * (g2 * 0.40 + disk), 4) == 0.5327
    assert (w1.state, w1.node_hours, w1.uptime_s) == ("STOPPED", 2.0, 0)  # 09:00Z -> 11:00Z, then stopped
    assert w1.usd_so_far == round(2.0 * (g2 * 0.40 + disk), 4) == 0.7103
    assert w1.usd_per_hour == round(disk, 4)  # a stopped VM bills its disk only
    assert round(st.usd_so_far, 4) == 3.8450
    d = st.as_dict()
    assert d["usd_so_far"] == 3.845 and d["estimate"].startswith("estimate: us-central1")
    assert "as of 2025-06" in st.note and "Spot" in st.note
