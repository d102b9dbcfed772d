"""What an evaluation leaves under a run, and how a run's models are named. No torch: the control
layer (CLI, dashboard) lists and reads these on an install without it.

    <run>/eval/<eval id>.json     one evaluation: state, which model, the figures (see below)
    <run>/final/model.onnx        `dtrain export --onnx` (MNIST), with final/model.onnx.json: its check
    <run>/export/step-XXXXXXXX/model.onnx[.json]     the same for a checkpoint's weights

An eval id is `eval-<UTC yyyymmdd-hhmmss>-<4 hex>`, like a run id, so ids sort by time. The record
is written with state "running" by whoever starts the evaluation and replaced by the evaluation
itself when it ends ("completed"), or by its starter when it fails ("failed", with the error line).
"""

from __future__ import annotations

import datetime
import re
import secrets
import time
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.common.rundir import STEP_RE, checkpoints, complete_meta, read_json, step_dir, write_json
from dtrain.common.storage import Store, is_remote, open_store

EVAL_DIR = "eval"
EVAL_ID_RE = re.compile(r"^eval-\d{8}-\d{6}-[0-9a-f]{4}$")


def new_eval_id(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"eval-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def eval_name(eval_id: str) -> str:
    if not EVAL_ID_RE.match(eval_id):
        # The id becomes a file name under the run: refuse anything else (a dashboard passes it from a URL).
        raise UserError(f"{eval_id!r} is not an eval id (expected eval-YYYYMMDD-HHMMSS-xxxx)")
    return f"{EVAL_DIR}/{eval_id}.json"


def write_record(run: Store, eval_id: str, record: dict[str, Any]) -> None:
    write_json(run, eval_name(eval_id), {**record, "id": eval_id, "updated": time.time()})


def read_record(run: Store, eval_id: str) -> dict[str, Any] | None:
    return read_json(run, eval_name(eval_id))


def mark_cancelled(run: Store, eval_id: str) -> None:
    """A queued evaluation's job was cancelled: its record, if it still says pending or running (the job
    never started, or was killed before it could say so), says failed."""
    record = read_record(run, eval_id) or {}
    if record.get("state") in ("pending", "running"):
        write_record(run, eval_id, {**record, "state": "failed", "error": "cancelled (dtrain cancel)"})


def list_records(run: Store) -> list[dict[str, Any]]:
    """Every evaluation of the run, newest first; a record that does not parse is listed as such."""
    out = []
    for path in sorted(run.list(EVAL_DIR), reverse=True):
        eval_id = path.rsplit("/", 1)[-1].removesuffix(".json")
        if not EVAL_ID_RE.match(eval_id):
            continue
        out.append(read_json(run, path) or {"id": eval_id, "state": "unreadable"})
    return out


def complete_steps(run: Store) -> list[int]:
    """The run's checkpoint steps that count (dtrain.common.rundir.complete_meta: meta.json lists every
    file at its size), oldest first. Read without torch, so a bad --checkpoint is refused before
    anything starts."""
    store = checkpoints(run)
    names = {p.split("/", 1)[0] for p in store.list("")}
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)) and complete_meta(store, n) is not None)


def check_step(run: Store, step: int) -> None:
    steps = complete_steps(run)
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise UserError(
            f"run {run.url} has no complete checkpoint at step {step} (its checkpoints: {have}); "
            "leave out --checkpoint to use the final model"
        )


def run_config(run: Store) -> dict[str, Any]:
    """The run's config.json; a directory without one is not a run."""
    saved = read_json(run, "config.json")
    if not saved or "workload" not in saved:
        raise UserError(f"{run.url} has no readable config.json: not a dtrain run (`dtrain runs` lists runs)")
    return saved


def onnx_paths(step: int | None) -> tuple[str, str]:
    """Where an ONNX export and its check go under the run: the final model's, or checkpoint `step`'s."""
    base = "final/model" if step is None else f"export/{step_dir(step)}/model"
    return f"{base}.onnx", f"{base}.onnx.json"


def read_prompts(spec: str) -> list[str]:
    """The non-empty lines of a local file or a gs:// object (LoRA prompts to continue)."""
    if not spec:
        return []
    try:
        if is_remote(spec):
            bucket_dir, _, name = spec.rpartition("/")
            data = open_store(bucket_dir).read_bytes(name)
        else:
            data = Path(spec).expanduser().read_bytes()
        text = data.decode("utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise UserError(f"--prompts {spec}: no such file") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompts {spec}: the file has no prompts (one a line)")
    return prompts
