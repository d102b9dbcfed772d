"""dtrain's cluster service: runs on a gcp cluster's master, restarts preempted Spot nodes (the requeued
Slurm job then resumes from its checkpoint) and stops the cluster when it has been idle (docs/service.md).

The decisions are dtrain.service.logic (no I/O); the loop and its I/O, dtrain.service.daemon."""
