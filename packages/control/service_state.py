"""What the cluster service (dtrain.service) says about a cluster, for `dtrain jobs` and `dtrain status`: its
state file on the master (`<workdir>/service/state.json`, next to the Slurm job table), read over SSH."""

from __future__ import annotations

import json
import shlex
from typing import Any

from dtrain.control.cluster import Cluster

STATE_FILE = "service/state.json"  # under the master's (Slurm login node's) workdir


def service_state(cluster: Cluster, *, accept_new_host_keys: bool = False) -> dict[str, Any] | None:
    """The service's state (dtrain.service.logic.State as a dict, with its `lines` to show), or None when
    the cluster has no service (no Slurm, or nothing written yet). Best effort: None on any failure."""
    from dtrain.control import launchers

    if not launchers.has(cluster, launchers.Feature.QUEUE):  # the service keeps its state beside the queue's
        return None
    from dtrain.control.slurm.session import Session

    try:
        with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
            p = s.slurm.query(f"cat {shlex.quote(s.workdir + '/' + STATE_FILE)} 2>/dev/null")
    except Exception:  # noqa: BLE001 - the service's section is extra: never fail the command over it
        return None
    if p.returncode != 0:
        return None
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None
