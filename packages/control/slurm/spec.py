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
JOB_KEYS = ("partition", "account", "gpus_per_node", "time", "constraint", "nodes", "stall_after", "max_continuations")
# A running job whose run has logged no metrics line for this long is `stalled` (docs/decisions.md).
STALL_AFTER_S = 30 * 60.0
# A job that reaches its time limit checkpoints and is requeued to continue its run, at most this many times
# (docs/decisions.md, "Jobs that outlive a Slurm time limit"): 20 allocations of a 24-hour cap are 3 weeks.
MAX_CONTINUATIONS = 20
# Slurm's warning signal before the time limit (sbatch --signal=B:USR1@<lead>): the batch step stops the job
# the way a preemption does and requeues it. WARN_S before the limit, or half a short limit (warning_lead_s).
WARN_SIGNAL = "USR1"
WARN_S = 120
MIN_WARN_S = 15  # a short limit's warning: a small model's checkpoint and the nodes' stop take a few seconds
SLURM_WARN_EARLY_S = 60  # how much earlier than asked Slurm may send it


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
    # Continuations of a job that reaches its time limit (0: none; the job ends TIMEOUT as Slurm ends it).
    max_continuations: int = MAX_CONTINUATIONS


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
        out["time"] = check_time(typed(spec["time"], str, "time", where), f"{where}: time")
    if "max_continuations" in spec:
        value = typed(spec["max_continuations"], int, "max_continuations", where)
        if value < 0:
            raise UserError(f"{where}: max_continuations must be >= 0 (0: a job that reaches its time limit ends)")
        out["max_continuations"] = value
    if "stall_after" in spec:
        out["stall_after"] = duration(spec["stall_after"], "stall_after", where)
    if "constraint" in spec:
        value = typed(spec["constraint"], str, "constraint", where)
        if not CONSTRAINT_RE.match(value):
            raise UserError(f'{where}: constraint {value!r} is not a node feature expression (e.g. "a100&ib")')
        out["constraint"] = value
    return out


def check_time(value: str, what: str) -> str:
    """`value` if it is one of Slurm's time limits (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS,
    UNLIMITED), else UserError: one line naming `what` (`--time`, or the table's key)."""
    if not TIME_RE.match(value.strip()) or (limit_seconds(value) or 0) < 0:
        raise UserError(
            f"{what} {value!r} is not a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH or D-HH:MM:SS (or UNLIMITED)"
        )
    return value.strip()


def limit_seconds(value: str) -> int | None:
    """A Slurm time limit in seconds (as sbatch reads it: one number is minutes, two are minutes and seconds,
    three hours, minutes and seconds; D- adds days and makes the next number hours); None: no limit ("",
    UNLIMITED, INFINITE, 0) or not a time limit. Minutes and seconds past 59 are refused (-1)."""
    text = value.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE") or not TIME_RE.match(text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, s = (parts + [0, 0])[:3]
        seconds = int(days) * 86400 + h * 3600 + m * 60 + s
        tail = parts[1:]
    else:  # MM, MM:SS, HH:MM:SS
        h, m, s = ([0, 0] + parts)[-3:] if len(parts) == 3 else (0, parts[0], parts[1] if len(parts) == 2 else 0)
        seconds = h * 3600 + m * 60 + s
        tail = parts[1:]
    if any(p > 59 for p in tail):
        return -1
    return seconds or None


def warning_lead_s(limit: int | None) -> int:
    """How long before the time limit Slurm is asked to send the warning signal. Slurm checks time limits
    periodically and sends the warning up to a minute earlier than asked (sbatch(1), --signal), never later:
    so WARN_S (time for a large model's checkpoint to reach its bucket), and for a short limit (under 6
    minutes) half of it less that minute, at least MIN_WARN_S: a 2-minute job is warned 45 to 105 s in.
    `limit` None: the partition's limit, unknown here."""
    if limit is None:
        return WARN_S
    return max(MIN_WARN_S, min(WARN_S, limit // 2 - SLURM_WARN_EARLY_S))
