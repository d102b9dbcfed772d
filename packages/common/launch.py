"""torchrun, with the job's exit code instead of torchrun's.

    python -m dtrain.common.launch <torchrun args> -m dtrain.mnist.train <workload args>

Arguments are exactly torchrun's. Plain torchrun exits 1 for any worker failure and prints a
ChildFailedError traceback; this wrapper exits with the first failed worker's own code (2 for a
usage error, 3 for preempted, 1 for a crash or a worker killed by a signal), and leaves the
diagnosis to the worker's one-line message. dtrain's launchers run it on every node, with the argv
`torchrun_argv` builds (the one place dtrain writes torchrun's command line).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from dtrain.common import env as envmod
from dtrain.common.errors import ExitCode
from dtrain.common.procs import dies_with_parent


def torchrun_argv(
    python: str,
    tail: Sequence[str],
    *,
    nproc: int | str,
    run_id: str,
    max_restarts: int = 0,
    nnodes: int | str = 1,
    master: str = "",
    is_host: bool = False,
    join_timeout: int = 0,
    local_addr: str = "",
) -> list[str]:
    """`python -m dtrain.common.launch` with torchrun's options, then `tail` (`-m MODULE ARGS` or `SCRIPT ARGS`):
    a c10d rendezvous with the run id as its id. `master` ("host:port", the store on the first node) for a job
    on several nodes: `is_host` on that node, `join_timeout` seconds for the others to join, and `local_addr`,
    the address this node is known by there. Without it, one node on this machine, the store on a free port
    (localhost:0). nproc and nnodes may be placeholders a Slurm node fills in (dtrain.common.slurmstep)."""
    argv = [python, "-m", "dtrain.common.launch", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", master or "localhost:0", "--rdzv-id", run_id]  # fmt: skip
    if master:
        argv += ["--rdzv-conf", f"is_host={int(is_host)},join_timeout={join_timeout}", "--local-addr", local_addr]
    return [*argv, "--max-restarts", str(max_restarts), *tail]


def exit_code_of(worker_code: int) -> int:
    """Map a worker's exit status (negative: killed by that signal) to ours."""
    if worker_code in (int(ExitCode.USAGE), int(ExitCode.PREEMPTED), int(ExitCode.INTERRUPTED)):
        return worker_code
    if worker_code == -signal.SIGINT:
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.FAILURE)


def main(argv: list[str] | None = None) -> int:
    if not envmod.debug():
        # torchrun's agent logs every shutdown step at WARNING; the workers already say what failed.
        # Some of its loggers take their level from LOGLEVEL when created (set it before the import),
        # the others inherit it from this parent.
        os.environ.setdefault("LOGLEVEL", "CRITICAL")
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    workers_die_with_agent()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        # One line naming the rank that failed first; torchrun has already stopped the others.
        print(f"dtrain: rank {rank} (local rank {failure.local_rank}) on {socket.gethostname()} {how}", flush=True)
        return exit_code_of(code)
    except SignalException as e:
        # torchrun itself was signalled; it has already sent the same signal to the workers and
        # waited for them (a SIGTERM'd worker checkpoints and exits PREEMPTED).
        return int(ExitCode.INTERRUPTED) if e.sigval == signal.SIGINT else 128 + int(e.sigval)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.OK)


def workers_die_with_agent() -> None:
    """Have every worker torchrun starts get SIGKILL when this agent dies, from before its Python
    starts: torchrun puts workers in sessions of their own, so without it a worker still importing
    torch outlives an agent killed with SIGKILL (dtrain.common.dist sets the same once torch is in,
    for workers started by a plain torchrun)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    popen = subprocess_handler.Popen

    def popen_dying_with_agent(*args: object, **kwargs: object) -> subprocess.Popen:
        kwargs.setdefault("preexec_fn", dies_with_parent(signal.SIGKILL))
        return popen(*args, **kwargs)

    # torch's SubprocessHandler calls the module's own `Popen` name: the one seam it offers.
    subprocess_handler.Popen = popen_dying_with_agent


if __name__ == "__main__":
    sys.exit(main())
