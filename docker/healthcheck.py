"""The training image's HEALTHCHECK: healthy while torchrun (dtrain.common.launch) runs and none of its
workers is a zombie (a worker that died while torchrun has not yet noticed, e.g. stuck in a collective).
Standard library only; reads /proc, so it needs no tools in the image.

Exit 0 healthy, 1 unhealthy (Docker's convention), with one line saying why.
"""

from __future__ import annotations

import os
import sys

LAUNCHER = "dtrain.common.launch"


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) for every process in the container."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(d)] = (int(fields[1]), fields[0], cmd)
    return out


def check(procs: dict[int, tuple[int, str, str]]) -> tuple[bool, str]:
    launchers = [pid for pid, (_pp, _st, cmd) in procs.items() if LAUNCHER in cmd]
    if not launchers:
        return False, "torchrun (dtrain.common.launch) is not running"
    workers = [pid for pid, (pp, _st, _cmd) in procs.items() if pp in launchers]
    dead = [pid for pid in workers if procs[pid][1] == "Z"]
    if dead:
        return False, f"worker process(es) {', '.join(map(str, dead))} exited and were not reaped"
    return True, f"torchrun running with {len(workers)} worker(s)"


def main() -> int:
    ok, why = check(processes())
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
