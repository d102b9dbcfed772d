"""Loaded by Python at start-up in every process of a dtrain job: the node agent puts this folder first on the
job's PYTHONPATH. With DTRAIN_INTERNAL_STACKS_DIR set, SIGUSR1 makes the process write every thread's Python
stack to <that folder>/<pid>.txt (faulthandler: it runs in the signal handler itself, so it answers even
while the main thread is stuck in C code, a collective or a CUDA call). The agent sends SIGUSR1 to a hung
rank, and saves the file into the run.

Then any other sitecustomize on the path (Debian's, a virtualenv's, a project's) runs as it would have."""

import importlib.machinery
import importlib.util
import os
import sys


def _register() -> None:
    folder = os.environ.get("DTRAIN_INTERNAL_STACKS_DIR")
    if not folder:
        return
    import faulthandler
    import signal

    try:
        f = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 - open for the process's life
    except OSError:
        return
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    sys.modules[__name__].__dict__["_stacks_file"] = f  # kept open: faulthandler writes to its descriptor


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_register()
_chain()
