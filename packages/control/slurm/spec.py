"""What a cluster says about its Slurm: `Cluster.slurm` (None: no Slurm; jobs start over SSH).

dtrain's own clusters (gcp, hosts with `slurm = true`) are `managed`: dtrain configures Slurm on their
nodes, every node computes, and the master is the login node (slurmctld runs there). A user's Slurm
cluster (backend = "slurm") is reached at its login node only; its compute nodes are Slurm's to pick.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.cluster import Node, duration, typed

MANAGED_PARTITION = "dtrain"  # the one partition dtrain's own clusters have: every node
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # partition and account names
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED.
TIME_RE = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}(:\d{2})?)?|UNLIMITED|INFINITE)$", re.I)
# Node features joined with & | , and counts, as sbatch --constraint takes them; no spaces or quotes.
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9_.&|,*:\[\]()-]{1,256}$")
# The options a [clusters.NAME] table may give for the jobs (slurm backend; hosts/gcp use the defaults).
JOB_KEYS = ("partition", "account", "gpus_per_node", "time", "constraint", "nodes", "stall_after")
# A running job whose run has logged no metrics line for this long is `stalled` (docs/decisions.md).
STALL_AFTER_S = 30 * 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmSpec:
    login: Node  # where dtrain runs sbatch, squeue, scancel (and keeps its job table, under login.workdir)
    managed: bool  # dtrain installs and configures Slurm on the cluster's nodes
    partition: str = ""  # "": the cluster's default partition
    account: str = ""
    gpus_per_node: int = 0  # --gres=gpu:N on every node of a job
    time: str = ""  # --time: the job's time limit ("": the partition's)
    constraint: str = ""  # --constraint: node features
    nodes: int = 0  # a job's default node count (0: every node of a managed cluster; 1 on a user's)
    # The login node's workdir is on the filesystem the compute nodes share (a user's cluster: /home). On
    # dtrain's own clusters each node has its own disk: the job's files are copied to every node.
    shared_workdir: bool = False
    # A running job whose metrics have not advanced for this long is stalled: `dtrain jobs` says so, and
    # autostop does not count it as activity (the table's stall_after).
    stall_after: float = STALL_AFTER_S


def job_options(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The job keys of a cluster table, checked: one line naming the key when one is wrong."""
    out: dict[str, Any] = {}
    for key in ("partition", "account"):
        if key in spec:
            value = typed(spec[key], str, key, where)
            if not NAME_RE.match(value):
                raise UserError(f"{where}: {key} {value!r} is not a Slurm {key} name (letters, digits, '.', '_', '-')")
            out[key] = value
    for key in ("gpus_per_node", "nodes"):
        if key in spec:
            value = typed(spec[key], int, key, where)
            if value < (1 if key == "nodes" else 0):
                raise UserError(f"{where}: {key} must be {'at least 1' if key == 'nodes' else '>= 0'}, got {value}")
            out[key] = value
    if "time" in spec:
        value = typed(spec["time"], str, "time", where)
        if not TIME_RE.match(value):
            raise UserError(
                f"{where}: time {value!r} is not a Slurm time limit: minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED"
            )
        out["time"] = value
    if "stall_after" in spec:
        out["stall_after"] = duration(spec["stall_after"], "stall_after", where)
    if "constraint" in spec:
        value = typed(spec["constraint"], str, "constraint", where)
        if not CONSTRAINT_RE.match(value):
            raise UserError(f'{where}: constraint {value!r} is not a node feature expression (e.g. "a100&ib")')
        out["constraint"] = value
    return out
