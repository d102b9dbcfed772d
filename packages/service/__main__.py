"""`python -m dtrain.service --config /etc/dtrain/service.json`: the cluster service (systemd runs it)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from dtrain.control.events import Events, Handle
from dtrain.service.daemon import LocalShell, Service, ServiceConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.service", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="the service's JSON config (dtrain up writes it)")
    parser.add_argument("--once", action="store_true", help="one poll, then exit")
    args = parser.parse_args(argv)
    try:
        cfg = ServiceConfig.load(args.config)
    except (OSError, ValueError, TypeError) as e:
        # fatal: one line for the journal and a non-zero exit; systemd's Restart= starts it again
        print(f"dtrain-service: cannot start: {args.config}: {e}", file=sys.stderr, flush=True)
        return 2

    from dtrain.control.gcp.lifecycle import connect

    def log(ev) -> None:  # journald keeps it: one line per event
        print(f"{time.strftime('%H:%M:%S')} {ev.kind}: {ev.message}", flush=True)

    handle = Handle()
    signal.signal(signal.SIGTERM, lambda *_: handle.terminate())
    signal.signal(signal.SIGINT, lambda *_: handle.interrupt())
    service = Service(cfg, gcp=connect(cfg.project, cfg.cluster), shell=LocalShell(), events=Events(log))
    service.run(handle, max_polls=1 if args.once else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
