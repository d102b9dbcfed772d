"""The `slurm` backend: a Slurm cluster the user already has, reached over SSH at its login node. dtrain
submits its jobs there with sbatch and reads Slurm's own records; it never configures that Slurm.

    [clusters.hpc]
    backend = "slurm"
    login = { host = "login.hpc.example.org", user = "me", key = "~/.ssh/id_ed25519" }
    partition = "gpu"              # default: the cluster's default partition
    account = "proj-123"           # sbatch --account
    gpus_per_node = 4              # --gres=gpu:4 on every node of a job
    time = "12:00:00"              # --time
    constraint = "a100"            # --constraint
    nodes = 2                      # a job's default --nodes (default 1)
    python = "/shared/envs/dtrain/bin/python"   # on the compute nodes (or image = "..." for containers)
    workdir = "dtrain"             # on the login node, on the filesystem the compute nodes share ($HOME)
    shared_fs = true               # --output may be a path on that filesystem (otherwise gs://)

The SSH rules are the hosts backend's: dtrain's known_hosts, strict host keys, --accept-new-host-keys.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import UserError
from dtrain.control.backends import base_dir, where
from dtrain.control.backends.hosts import CLUSTER_KEYS, hosts_cluster
from dtrain.control.cluster import Cluster, check_keys, typed
from dtrain.control.slurm.spec import JOB_KEYS, SlurmSpec, job_options

if TYPE_CHECKING:
    from dtrain.control.settings import ClusterConfig

LOGIN_KEYS = ("host", "user", "key", "port")
# The login node's keys that apply to the jobs' nodes too (one Python and one workdir, on shared storage).
NODE_KEYS = ("python", "workdir", "interface")
TABLE_KEYS = CLUSTER_KEYS - {"nodes", "slurm"}  # rdzv_port, known_hosts, env, shared_fs, image, ...
SLURM_KEYS = frozenset({"login", *JOB_KEYS, *NODE_KEYS, *TABLE_KEYS})


class Slurm:
    name = "slurm"
    keys = SLURM_KEYS
    provisions = False

    def check(self, cfg: ClusterConfig) -> None:
        check_keys(cfg.spec, set(SLURM_KEYS), where(cfg))
        job_options(cfg.spec, where(cfg))

    def cluster(self, cfg: ClusterConfig) -> Cluster:
        """The login node as the cluster's one node (what dtrain reaches over SSH), and its Slurm."""
        w = where(cfg)
        login = cfg.spec.get("login")
        if not isinstance(login, dict) or not login.get("host"):
            raise UserError(f'{w}: login = {{ host = "...", user = "...", key = "..." }} is required')
        check_keys(login, set(LOGIN_KEYS), f"{w}: login")
        node = {
            "name": "login",
            "address": typed(login["host"], str, "login.host", w),
            **{k: login[k] for k in ("user", "key", "port") if k in login},
            **{k: cfg.spec[k] for k in NODE_KEYS if k in cfg.spec},
        }
        table: dict[str, Any] = {k: v for k, v in cfg.spec.items() if k in TABLE_KEYS}
        built = hosts_cluster(cfg.name, {**table, "nodes": [node]}, cfg.source or "dtrain.toml", base_dir(cfg))
        options = job_options(cfg.spec, w)
        spec = SlurmSpec(login=built.master, managed=False, shared_workdir=True, **options)
        return dataclasses.replace(built, backend="slurm", launcher="slurm", slurm=spec)


BACKEND = Slurm()
