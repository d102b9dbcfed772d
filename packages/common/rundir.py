"""The run layout and run ids. No torch: the CLI uses this to list and resolve runs.

<output>/<run-id>/config.json     the full resolved config (written at start)
                  status.json     state, exit code, step, best metric (updated at the end)
                  metrics.jsonl   one line per log step
                  checkpoints/    step-XXXXXXXX/{state.pt,meta.json} and LATEST (dtrain.common.checkpoint
                                  writes them; finding the newest complete one needs no torch: here)
                  ckpt/           instead of checkpoints/ when the job's checkpoint directory was a local
                                  folder on each node: its copies (dtrain.common.mirror); `checkpoints`
                                  reads either
                  final/          the exported model
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import DiskFull, Store, is_remote, open_store

STEP_RE = re.compile(r"^step-(\d{8})$")
META_FILE = "meta.json"
LATEST = "LATEST"
CHECKPOINTS = "checkpoints"  # a built-in's checkpoints, written in place (a run on this machine, a shared folder)
CKPT_PREFIX = "ckpt"  # the copies of a job's node-local checkpoint directory (dtrain.common.mirror's layout)
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
        # config.json (the job's), status.json (a launcher records a start before the program writes anything)
        if store.exists("config.json") or store.exists("status.json") or store.list(CHECKPOINTS):
            return store
    raise UserError(
        f"no run {ref!r} found (looked in {', '.join(candidates)}): "
        "`dtrain runs` lists runs, or pass the run's directory"
    )


def run_disk_full(e: DiskFull, run_id: str, *, resumed: bool) -> UserError:
    """A full disk while writing a run's own files (config.json, status.json) at its start: one line; writes
    replace files whole, so what was there is intact."""
    then = f"resume again (--resume {run_id})" if resumed else "start again"
    return UserError(
        f"disk full: writing {e.path} needed {e.needed:,} bytes, {e.free:,} were free; the run's files are as "
        f"they were: free space and {then}",
        exit_code=ExitCode.FAILURE,
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


# ---------------------------------------------------------------------------------------------
# checkpoints/: which checkpoint is the newest complete one


def checkpoints(run: Store) -> Store:
    """The run's checkpoint directory, to read: `checkpoints/` where the job wrote it in place, else the
    newest complete copies of the nodes' local directories under `ckpt/` (a mirror.MirrorView), else the
    (empty) `checkpoints/`. A user's program's copies are its own files, in no layout of dtrain's: not read."""
    here = run.child(CHECKPOINTS)
    if here.list(""):
        return here
    copies = run.child(CKPT_PREFIX)
    if (read_json(run, "config.json") or {}).get("kind") == "program":
        return here
    if any(n.startswith("node-") for n in copies.list("")):
        from dtrain.common.mirror import MirrorView

        return MirrorView(copies)
    return here


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


@dataclasses.dataclass(frozen=True)
class Found:
    step: int
    name: str
    meta: dict[str, Any]


def find_latest(store: Store, log: Callable[[str], None] = lambda _m: None) -> Found | None:
    """The newest complete checkpoint under `store` (the run's checkpoints/ prefix), or None."""
    names = {p.split("/", 1)[0] for p in store.list("")}
    steps = sorted((int(m.group(1)), n) for n in names if (m := STEP_RE.match(n)))
    hinted = None
    with contextlib.suppress(FileNotFoundError):
        hinted = store.read_bytes(LATEST).decode().strip()
    for step, name in reversed(steps):
        meta = complete_meta(store, name)
        if meta is not None:
            if hinted and hinted != name:
                log(f"checkpoints/LATEST names {hinted}, but the newest complete checkpoint is {name}")
            return Found(step, name, meta)
        log(f"skipping incomplete checkpoint {name} (an interrupted save)")
    return None


def last_checkpoint_name(url: str) -> str:
    """The name of the last complete checkpoint (step-XXXXXXXX) of the run at `url`, in either layout
    (checkpoints()), "" before the first: what `dtrain cancel` says it kept."""
    found = find_latest(checkpoints(open_store(url)))
    return found.name if found else ""


def complete_meta(store: Store, name: str) -> dict[str, Any] | None:
    try:
        meta = json.loads(store.read_bytes(f"{name}/{META_FILE}"))
        for fname, info in meta["files"].items():
            if store.size(f"{name}/{fname}") != info["size"]:
                return None
        return meta
    except (FileNotFoundError, ValueError, KeyError):
        return None
