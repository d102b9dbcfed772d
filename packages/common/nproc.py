"""How many processes a node runs for one job: the rule every launcher applies (this machine,
SSH, the Slurm batch step on each node), in one place. Standard library only: Slurm's node step
applies it on nodes that may have nothing else installed."""

from __future__ import annotations

from dtrain.common.errors import UserError

# --oversubscribe lifts the one-process-per-core (or per-GPU) limit up to this many per core: past
# it a machine spends its time switching processes and its memory on copies of torch.
MAX_PROCS_PER_CORE = 4


def auto_nproc(gpus: int, cpus: int) -> int:
    """One process per GPU; on CPU, two processes (real DDP) when there are two cores or more,
    each with half the cores as threads."""
    if gpus:
        return gpus
    return 2 if cpus >= 2 else 1


def processes(nproc: int, *, gpus: int, cpus: int, oversubscribe: bool, where: str = "this machine") -> int:
    """The processes to start per node: `nproc` (0: auto), refused past one per GPU (with GPUs) or one
    per core (without), unless `oversubscribe`; never past MAX_PROCS_PER_CORE per core."""
    if not nproc:
        return auto_nproc(gpus, cpus)
    ceiling = MAX_PROCS_PER_CORE * cpus
    if oversubscribe:
        if nproc > ceiling:
            raise UserError(
                f"--nproc {nproc} is more than {MAX_PROCS_PER_CORE} processes per core even with --oversubscribe "
                f"({where} has {cpus} cores): use --nproc {ceiling} or fewer"
            )
        return nproc
    limit, unit = (gpus, "GPU(s)") if gpus else (cpus, "CPU core(s)")
    if nproc > limit:
        raise UserError(
            f"--nproc {nproc} is more processes than {where}'s {limit} {unit}: use --nproc {limit} or fewer, "
            "or add --oversubscribe to run more anyway"
        )
    return nproc
