"""How a job starts on a cluster's nodes: one module per way, behind one interface.

A launcher takes a `Plan` (what runs, where the run lives, which nodes) and carries it through the same
five steps every way of starting a job has:

    prepare   reach every node and check it (interpreter, torch, cores/GPUs, the rendezvous port)
    sync      the code (the user's working directory, dtrain's node-side code) and its requirements
    execute   the program on every node (torchrun for a script or module, once per node for a command)
    stop      a stop asked through the Handle: SIGTERM and the stop file, a grace period, then SIGKILL
    collect   each node's exit code and last lines, the last copy of the checkpoint directory, the run's status

    here    this machine (no SSH)                      dtrain.control.launchers.here
    ssh     every node of a hosts or gcp cluster        dtrain.control.launchers.ssh
    slurm   an allocation of a Slurm cluster           dtrain.control.launchers.slurm

`Cluster.launcher` names one (backends choose it); nothing else compares that name. A new way of starting
jobs (Kubernetes, say) is one new module here with `LAUNCHER`, and one line in REGISTRY.

What each can do is declared (`features(cluster)`, model: SkyPilot's CloudImplementationFeatures), never
guessed from its name or its cluster's Slurm: a command asks `has(cluster, Feature.X)`, and `require` refuses
one that needs a feature its cluster lacks, in one line that names both.

The built-in examples (dtrain mnist, lora) are Plans like any user's program: a module run under torchrun
(their `Builtin.module`) with their own flags, its run placed as a program's (`Plan.target`), made so by the
front door (dtrain.control.launch.builtin_job); nothing here or below names them. They run exactly as a
user's script does on every launcher (userjob.run_program_here, remote_program.launch_program_cluster,
slurm.programs.run_program: the same contract, their checkpoints in $DTRAIN_CHECKPOINT_DIR, copied to the
run's ckpt/ where that is not the run's own folder). What differs is data the front door put in the Plan:
`own_config` (the program writes its run's config.json itself) and `line`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import TYPE_CHECKING, Protocol

from dtrain.common.errors import UserError
from dtrain.common.jobenv import STOP_GRACE_S
from dtrain.common.resources import SAMPLE_EVERY_S

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster
    from dtrain.control.events import Events, Handle
    from dtrain.control.launch_result import LaunchResult
    from dtrain.control.program import Job
    from dtrain.control.userjob import Target


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One job, resolved: what runs, where its run lives, on which nodes, with which launch options."""

    job: Job
    target: Target  # the run: its id, its store, its starts so far
    cluster: Cluster
    # The program writes its run's config.json itself, with its whole resolved config (dtrain's built-ins);
    # else dtrain writes it when a new run starts (userjob.program_config), and the run is a program run.
    own_config: bool = False
    line: str = ""  # the program's line as the launch message shows it ("": none, as for a built-in's flags)
    nproc: int = 0  # processes per node for torchrun (0: one per GPU, or 2 on CPU)
    max_restarts: int = 0
    hang_timeout: float | None = None  # the node agents' hang timeout: None from the step time, 0 off (docs/hangs.md)
    startup_timeout: float | None = None  # the start-up bound: None progress.STARTUP_TIMEOUT_S, 0 none (docs/hangs.md)
    sample_interval: float = SAMPLE_EVERY_S  # seconds between resource samples on each node (0: off)
    image: str = ""  # container mode: run in this image on every node
    accept_new_host_keys: bool = False
    oversubscribe: bool = False
    tty: bool = False  # the caller's output is a terminal (a built-in draws a live bar)
    debug: bool = False
    grace_s: float = STOP_GRACE_S
    # Node paths the program's arguments name (a built-in's --data-dir, a folder --output), mounted at the same
    # place in container mode: (path, "ro" | "rw").
    mounts: tuple[tuple[str, str], ...] = ()


class Feature(enum.Enum):
    """What a launcher can do for a cluster; the value is how a refusal names it."""

    LOCAL = "this machine's own processes"  # it runs here: gpus, node states and eval run without SSH
    SSH = "nodes reached over SSH"  # doctor, exec, ssh, and the node queries that are not LOCAL
    NODE_CHECKS = "checks of every node"  # doctor's per-node checks (a user's Slurm: only its login node)
    GPU_QUERY = "a query of its nodes' GPUs"  # dtrain gpus, the nodes' states (status, dashboard)
    EVAL = "evaluation on its nodes"  # dtrain eval --cluster
    QUEUE = "a job queue"  # submit, jobs, cancel, logs JOB, eval --queue; its scheduler picks the nodes
    TIME_LIMIT = "a job time limit"  # --time
    CONTAINERS = "containers"  # --image, a cluster's image


# What to do instead, after a refusal (require's `hint` replaces it where a command knows better).
HINTS = {
    Feature.LOCAL: "run it on this machine (leave out --cluster)",
    Feature.SSH: "pass --cluster NAME (a [clusters.NAME] in dtrain.toml)",
    Feature.NODE_CHECKS: "check its nodes with its own tools",
    Feature.GPU_QUERY: "run nvidia-smi on its nodes yourself",
    Feature.EVAL: "evaluate on this machine (leave out --cluster)",
    Feature.QUEUE: 'jobs queue on Slurm clusters (backend = "slurm", a hosts cluster with slurm = true, or gcp); '
    "on this one use `dtrain train`",
    Feature.TIME_LIMIT: "leave it out, or run on a Slurm cluster (--cluster NAME)",
    Feature.CONTAINERS: "add --cluster NAME (a hosts, gcp or Slurm cluster); on this machine use "
    "`docker compose --profile cpu up` or docker run (see compose.yaml)",
}


class Launcher(Protocol):
    name: str  # the Cluster.launcher value it serves
    place: str  # how a message names a cluster it runs: "cluster {name!r}", "this machine"

    def features(self, cluster: Cluster) -> frozenset[Feature]:
        """What it can do for `cluster` (require() refuses the rest)."""
        ...

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        """prepare, sync, execute (stop through `handle`), collect; the run and the job's exit code (ExitCode)."""
        ...


REGISTRY = {
    "local": "dtrain.control.launchers.here",
    "ssh": "dtrain.control.launchers.ssh",
    "slurm": "dtrain.control.launchers.slurm",
    "kubernetes": "dtrain.control.launchers.kubernetes",
}


def get(name: str) -> Launcher:
    if name not in REGISTRY:
        raise UserError(f"unknown launcher {name!r} (known: {', '.join(REGISTRY)})")
    return importlib.import_module(REGISTRY[name]).LAUNCHER


def has(cluster: Cluster, feature: Feature) -> bool:
    return feature in get(cluster.launcher).features(cluster)


def require(cluster: Cluster, feature: Feature, what: str = "", hint: str = "") -> None:
    """Refuse, in one line naming the cluster and the feature (and `what` needs it: a command, a flag), work on
    a cluster whose launcher does not declare `feature`."""
    if not has(cluster, feature):
        where = get(cluster.launcher).place.format(name=cluster.name)
        lack = f"{what} needs {feature.value}, and {where} has none" if what else f"{where} lacks {feature.value}"
        raise UserError(f"{lack}: {hint or HINTS[feature]}")


def job_cluster(cluster: Cluster, *, image: str = "", time: str = "") -> Cluster:
    """The cluster as one job sees it, for a built-in and a user's program alike: `image` (--image) becomes
    its image (container mode); refused in one line are an --image where there are no containers, a --time
    where there is no time limit, and a cluster that runs jobs only in an image and has none."""
    if image:
        from dtrain.control.cluster import check_image

        require(cluster, Feature.CONTAINERS, "--image")
        cluster = dataclasses.replace(cluster, image=check_image(image, "--image"))
    if time:
        require(cluster, Feature.TIME_LIMIT, "--time")
    if cluster.needs_image and not cluster.image:
        raise UserError(
            f"cluster {cluster.name!r} runs jobs in a container image and has none: run dtrain build --cluster "
            f'{cluster.name}, or set image = "..." in [clusters.{cluster.name}], or pass --image'
        )
    return cluster
