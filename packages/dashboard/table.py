"""The runs table as people and scripts ask for it: filtered by status, workload or a word, sorted by
a column. The Runs page and GET /api/v1/runs take the same query parameters and use this."""

from __future__ import annotations

import dataclasses
from typing import Any

# column -> the row's key it sorts by
SORT_KEYS = {
    "run": "run_id",
    "status": "status",
    "workload": "workload",
    "started": "created",
    "duration": "duration_s",
    "step": "last_step",
    "best": "best_value",
    "world": "world_size",
    "hosts": "hosts",
}
DEFAULT_SORT = "started"


@dataclasses.dataclass(frozen=True)
class Query:
    status: str = ""  # one state, e.g. running
    workload: str = ""
    q: str = ""  # a word in the run id, workload, status, hosts, error or stragglers ("straggler": any)
    sort: str = DEFAULT_SORT
    desc: bool = True

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise ValueError(f"sort: one of {', '.join(SORT_KEYS)}, not {self.sort!r}")


def query(status: str = "", workload: str = "", q: str = "", sort: str = DEFAULT_SORT, desc: bool = True) -> Query:
    """A Query from a request's parameters (a FastAPI dependency of the Runs page and GET /runs)."""
    return Query(status, workload, q, sort, desc)


def select(rows: list[dict[str, Any]], query: Query) -> list[dict[str, Any]]:
    """The rows that match `query`, in its order; rows without a value for the sort column come last
    whichever the direction."""
    word = query.q.strip().lower()
    kept = [
        r
        for r in rows
        if (not query.status or r["status"] == query.status)
        and (not query.workload or r["workload"] == query.workload)
        and (not word or word in _text(r))
    ]
    key = SORT_KEYS[query.sort]
    present = [r for r in kept if r.get(key) not in (None, [])]
    missing = [r for r in kept if r.get(key) in (None, [])]
    present.sort(key=lambda r: _sortable(r[key]), reverse=query.desc)
    return present + missing


def _text(row: dict[str, Any]) -> str:
    parts = [row["run_id"], row.get("workload"), row.get("status"), row.get("error"), *row.get("hosts", [])]
    parts += [f"straggler {name}" for name in row.get("stragglers") or {}]  # q=straggler finds the runs with one
    return " ".join(str(p) for p in parts if p).lower()


def _sortable(value: Any) -> Any:
    return ",".join(value) if isinstance(value, list) else value
