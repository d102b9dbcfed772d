"""The `kubernetes` backend: a Kubernetes cluster with the Kubeflow training operator (v1, PyTorchJob), that the
user's own kubectl reaches. dtrain renders a job's manifests for it and writes them into the run
(dtrain.control.launchers.kubernetes); it never talks to the API server, so it makes no machines and reads no
node list: the nodes below are the job's pods (one master, the rest workers), as the manifests will ask for them.

    [clusters.k8s]
    backend = "kubernetes"
    image = "us-central1-docker.pkg.dev/PROJECT/REPO/dtrain-train:src-0123456789ab"  # or --image
    bucket = "gs://my-bucket"        # runs go to gs://my-bucket/runs/<run>/ (every pod reads and writes there)
    namespace = "ml"                 # default "default"
    nodes = 2                        # pods: 1 Master + 1 Worker (default 1)
    gpus_per_node = 1                # nvidia.com/gpu limit of each pod (default 0: CPU)
    nproc = 1                        # processes per pod (default: gpus_per_node, or 1)
    cpus = 4                         # each pod's cpu request and limit (default: none set)
    memory = "16Gi"                  # each pod's memory request and limit (default: none set)
    rdzv_port = 29400                # the master's rendezvous port (the PyTorchJob's pytorchjob-port)
    env = { NCCL_DEBUG = "WARN" }    # set for the job in every pod
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import UserError
from dtrain.control.backends import where
from dtrain.control.cluster import DEFAULT_RDZV_PORT, Cluster, Node, check_image, check_keys, env_table, typed

if TYPE_CHECKING:
    from dtrain.control.settings import ClusterConfig

KEYS = frozenset({"image", "bucket", "namespace", "nodes", "gpus_per_node", "nproc", "cpus", "memory", "rdzv_port",
                  "env"})  # fmt: skip
# A namespace is a DNS-1123 label (Kubernetes' own rule for it).
NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A memory quantity: a number with an optional binary or decimal suffix ("16Gi", "512M", "1e9").
MEMORY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
BUCKET_RE = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,221}[a-z0-9](/[^\s]*)?$")
MAX_NODES = 1000


def _count(spec: dict[str, Any], key: str, default: int, low: int, w: str) -> int:
    value = typed(spec.get(key, default), int, key, w)
    if not low <= value <= MAX_NODES:
        raise UserError(f"{w}: {key} must be from {low} to {MAX_NODES}, got {value}")
    return value


def options(cfg: ClusterConfig) -> dict[str, Any]:
    """The table, checked (one line naming the key for each mistake), as the launcher reads it."""
    w, spec = where(cfg), dict(cfg.spec)
    check_keys(spec, set(KEYS), w)
    image = typed(spec.get("image", ""), str, "image", w)
    bucket = typed(spec.get("bucket", ""), str, "bucket", w).rstrip("/")
    if bucket and not BUCKET_RE.match(bucket):
        raise UserError(f'{w}: bucket must be a gs:// URL the pods can reach (bucket = "gs://NAME"), got {bucket!r}')
    namespace = typed(spec.get("namespace", "default"), str, "namespace", w)
    if not NAMESPACE_RE.match(namespace):
        raise UserError(
            f"{w}: namespace must be a Kubernetes name (lower-case letters, digits, '-'), got {namespace!r}"
        )
    gpus = _count(spec, "gpus_per_node", 0, 0, w)
    memory = spec.get("memory", "")
    if memory != "" and not (isinstance(memory, str) and MEMORY_RE.match(memory)):
        raise UserError(f'{w}: memory must be a Kubernetes quantity like "16Gi" or "512Mi", got {memory!r}')
    port = typed(spec.get("rdzv_port", DEFAULT_RDZV_PORT), int, "rdzv_port", w)
    if not 1 <= port <= 65535:
        raise UserError(f"{w}: rdzv_port must be a TCP port (1-65535), got {port}")
    return {
        "image": check_image(image, w) if image else "",
        "bucket": bucket,
        "namespace": namespace,
        "nodes": _count(spec, "nodes", 1, 1, w),
        "gpus_per_node": gpus,
        "nproc": _count(spec, "nproc", gpus or 1, 1, w),
        "cpus": _count(spec, "cpus", 0, 0, w),
        "memory": memory,
        "rdzv_port": port,
        "env": env_table(spec.get("env", {}), w),
    }


class Kubernetes:
    name = "kubernetes"
    keys = KEYS
    provisions = False

    def check(self, cfg: ClusterConfig) -> None:
        options(cfg)

    def cluster(self, cfg: ClusterConfig) -> Cluster:
        """The job's pods as nodes (master-0, worker-0, ...: each pod's name is the job's name, then this), in
        the image, with the runs in the bucket; what only the manifests use goes in `options`."""
        o = options(cfg)
        names = ["master-0", *(f"worker-{i}" for i in range(o["nodes"] - 1))]
        return Cluster(
            name=cfg.name,
            backend=self.name,
            nodes=tuple(Node(name=n, address=n, gpus=o["gpus_per_node"], master=i == 0) for i, n in enumerate(names)),
            rdzv_port=o["rdzv_port"],
            env=o["env"],
            default_output=f"{o['bucket']}/runs" if o["bucket"] else "",
            image=o["image"],
            needs_image=True,  # a pod is its image: there is no node Python to sync to
            launcher="kubernetes",
            options={k: o[k] for k in ("namespace", "gpus_per_node", "nproc", "cpus", "memory")},
        )


BACKEND = Kubernetes()
