"""The environment dtrain gives a job's processes, in one place: the names the node agent sets, the
SDK (dtrain.sdk) reads, and docs/user-code.md documents. Standard library only.

A Python script or module runs under torchrun and also gets torchrun's own variables (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*). A command runs
once per node and gets COMMAND_ENV's plain names (what Lightning reads, and what a user passes to
`accelerate launch --machine_rank $NODE_RANK ...`).

None of dtrain's names is a setting's variable (settings.env_name): a job that calls `dtrain` itself
is not taken to have set `run.run_id`.
"""

from __future__ import annotations

RUN = "DTRAIN_RUN"  # the run id
RUN_URL = "DTRAIN_RUN_URL"  # the run's directory or gs:// URL (logs, metrics, config, status)
CHECKPOINT_DIR = "DTRAIN_CHECKPOINT_DIR"  # a local directory on every node, copied to the run's store
RESTART_COUNT = "DTRAIN_RESTART_COUNT"  # 0 on the first start; +1 per relaunch, requeue or --resume
STOP_FILE = "DTRAIN_STOP_FILE"  # exists once a stop was asked for (preemption notice, cancel, SIGTERM)
METRICS_FILE = "DTRAIN_METRICS_FILE"  # local JSONL the SDK appends metrics to; dtrain forwards it to the run
CODE_DIR = "DTRAIN_CODE_DIR"  # the job's working directory on the node (the synced copy of the user's)
NODE_RANK = "DTRAIN_NODE_RANK"
NNODES = "DTRAIN_NNODES"
NPROC_PER_NODE = "DTRAIN_NPROC_PER_NODE"
MASTER_ADDR = "DTRAIN_MASTER_ADDR"
MASTER_PORT = "DTRAIN_MASTER_PORT"  # a free port on the master, for the job's own rendezvous
# A node-local directory: each rank's heartbeat, <dir>/rank-<RANK> = "<step> <unix time>", written by
# dtrain.sdk.log(step=...) at most once a second; the node agent reads it to find hung ranks (docs/hangs.md).
PROGRESS_DIR = "DTRAIN_PROGRESS_DIR"
# The trackers `dtrain.sdk.log` also reports to ("mlflow,wandb"): the run's `tracker` setting (DTRAIN_TRACKER,
# [run] tracker), which the launcher puts in a program's job environment (docs/trackers.md).
TRACKERS = "DTRAIN_TRACKERS"

# A stop (cancel, preemption, a time limit's warning, a lost launcher) is SIGTERM and the stop file, then this
# long before SIGKILL: torchrun gives its workers 30 s after SIGTERM, and GCE gives a Spot VM about 30 s. Every
# launcher and agent takes it from here.
STOP_GRACE_S = 45.0

ALL = frozenset(
    {
        RUN,
        RUN_URL,
        CHECKPOINT_DIR,
        RESTART_COUNT,
        STOP_FILE,
        METRICS_FILE,
        CODE_DIR,
        NODE_RANK,
        NNODES,
        NPROC_PER_NODE,
        MASTER_ADDR,
        MASTER_PORT,
        PROGRESS_DIR,
        TRACKERS,
    }
)

# A command (not a script) also gets these, the names other launchers read.
COMMAND_ENV = {
    "NODE_RANK": NODE_RANK,
    "NNODES": NNODES,
    "NPROC_PER_NODE": NPROC_PER_NODE,
    "MASTER_ADDR": MASTER_ADDR,
    "MASTER_PORT": MASTER_PORT,
}

# Experiment trackers' own settings (MLflow, Weights & Biases), passed from the launching shell to every node's
# processes as they are, so a program that already logs to them (and the built-ins' --tracker) works unchanged on
# every backend. dtrain reads none of them but through the trackers' libraries (dtrain.common.trackers).
TRACKER_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_BASE_URL",
    "WANDB_API_KEY",
    "WANDB_RUN_GROUP",
    "WANDB_TAGS",
)
# Of those, the secrets: they travel to the nodes only on a launcher's stdin (the SSH launcher's job spec), and
# are never written into a file dtrain makes (a Slurm job's job.json leaves them out: docs/user-code.md).
SECRET_ENV = frozenset({"MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"})
