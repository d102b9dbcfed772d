"""The run layout and run ids. No torch: the CLI uses this to list and resolve runs.

<output>/<run-id>/config.json     the full resolved config (written at start)
                  status.json     state, exit code, step, best metric (updated at the end)
                  metrics.jsonl   one line per log step
                  checkpoints/    see dtrain.common.checkpoint
                  final/          the exported model
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from typing import Any

from dtrain.common.errors import UserError
from dtrain.common.storage import Store, is_remote, open_store

RUN_ID_RE = re.compile(r"^(?P<workload>[a-z0-9]+)-(?P<stamp>\d{8}-\d{6})-(?P<hex>[0-9a-f]{4})$")


def new_run_id(workload: str, now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{workload}-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def run_location(workload: str, output: str, run_id: str = "") -> tuple[str, Store]:
    """A new run's id (`run_id`, or a fresh one) and its directory under `output`: the one place that
    says where a run lives. The launcher calls it and hands the directory down (`--run-dir`); a
    workload started by a plain torchrun calls it itself."""
    run_id = run_id or new_run_id(workload)
    return run_id, open_store(f"{output.rstrip('/')}/{run_id}")


def locate(output: str, ref: str) -> Store:
    """The run directory for `--resume REF`: a run id under `output`, or a path / gs:// URL."""
    candidates = [ref] if is_remote(ref) or "/" in ref else [f"{output.rstrip('/')}/{ref}", ref]
    for c in candidates:
        store = open_store(c)
        if store.exists("config.json") or store.list("checkpoints"):
            return store
    raise UserError(
        f"no run {ref!r} found (looked in {', '.join(candidates)}): "
        "`dtrain runs` lists runs, or pass the run's directory"
    )


def read_json(store: Store, name: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.read_bytes(name))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def config_diff(saved: dict[str, Any], current: dict[str, Any], where: str = "the checkpoint") -> str:
    """'width: 16 in the checkpoint, 32 now' for each key that differs."""
    keys = sorted(set(saved) | set(current))
    return "; ".join(
        f"{k}: {saved.get(k)!r} in {where}, {current.get(k)!r} now" for k in keys if saved.get(k) != current.get(k)
    )


def write_json(store: Store, name: str, obj: dict[str, Any]) -> None:
    store.write_bytes(name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
