"""torchrun, with the job's exit code instead of torchrun's.

    python -m dtrain.common.launch <torchrun args> -m dtrain.mnist.train <workload args>

Arguments are exactly torchrun's. Plain torchrun exits 1 for any worker failure and prints a
ChildFailedError traceback; this wrapper exits with the first failed worker's own code (2 for a
usage error, 3 for preempted, 1 for a crash or a worker killed by a signal), and leaves the
diagnosis to the worker's one-line message. dtrain's launchers run it on every node.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

from dtrain.common import env as envmod
from dtrain.common.errors import ExitCode
from dtrain.common.procs import dies_with_parent


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
