"""The whole suite in shards that run side by side (scripts/test.sh, DTRAIN_TEST_SHARDS): most of the slow tests
wait (on Slurm's scheduler, a time limit, a hang being found, a container starting), so two pytest sessions on two
cores finish the suite in much less time than one.

How the tests are split:
- A group is what must stay in one session: the tests that use a session-scoped fixture defined below the top
  conftest.py (a test bed: tests/slurm, tests/cluster, tests/docker, ...), so that each bed is still built once;
  every other test is its own file's group.
- Groups go to shards by longest-first onto the least-loaded shard, weighed by tests/durations.json (each test's
  seconds in a measured whole run; refresh it with `python tests/shards.py durations LOG...` from the logs a run
  leaves, see scripts/test.sh). A test it does not know weighs UNKNOWN_S, or UNKNOWN_SLOW_S if marked slow (a
  slow test here takes 20 s to 5 minutes).
- Every session collects the whole suite and keeps its own shard: the split is the same in each, so together they
  run every test once. Each writes what it kept to a report; `check` proves the shards cover the whole collection
  and that it holds default and slow tests both (what the one-session run checks on its own).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
TOP = Path(__file__).parent
UNKNOWN_S = 1.0
UNKNOWN_SLOW_S = 60.0


def parse(spec: str) -> tuple[int, int]:
    """'K/N' (shard K of N, from 0) as (K, N)."""
    k, _, n = spec.partition("/")
    shard, count = int(k), int(n)
    if not 0 <= shard < count:
        raise ValueError(f"shard {spec!r}: K/N with 0 <= K < N")
    return shard, count


def group_of(item: pytest.Item) -> str:
    """The group of a test (see above): the home of the first test bed it uses, else its file."""
    try:
        top_id = TOP.relative_to(item.config.rootpath).as_posix()  # the top conftest's fixtures: cheap, per shard
    except ValueError:
        top_id = ""
    top_id = "" if top_id == "." else top_id
    info = getattr(item, "_fixtureinfo", None)
    homes = sorted(
        d.baseid
        for defs in (info.name2fixturedefs.values() if info else ())
        for d in defs
        if d.scope == "session" and d.baseid not in ("", top_id)
    )
    return homes[0] if homes else item.nodeid.split("::")[0]


def weights(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def split(items: list[pytest.Item], count: int, known: dict[str, float]) -> dict[str, int]:
    """Each group's shard: the heaviest group first, onto the shard with the least planned time (ties: the lower
    shard, then the group's name: the same on every run)."""
    load: dict[str, float] = defaultdict(float)
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        load[group_of(item)] += known.get(item.nodeid, UNKNOWN_SLOW_S if slow else UNKNOWN_S)
    planned = [0.0] * count
    where: dict[str, int] = {}
    for group in sorted(load, key=lambda g: (-load[g], g)):
        shard = min(range(count), key=lambda i: (planned[i], i))
        where[group] = shard
        planned[shard] += load[group]
    return where


def keep(items: list[pytest.Item], spec: str, report: str | None) -> list[pytest.Item]:
    shard, count = parse(spec)
    where = split(items, count, weights())
    kept = [item for item in items if where[group_of(item)] == shard]
    if report:
        slow = sum(1 for item in kept if item.get_closest_marker("slow") is not None)
        Path(report).write_text(json.dumps({
            "shard": shard, "shards": count, "collected": len(items), "kept": len(kept),
            "default": len(kept) - slow, "slow": slow,
        }))  # fmt: skip
    return kept


def check(reports: list[Path], count: int, full_suite: bool) -> int:
    """0 when the shards' reports cover the whole collection (and, for the whole suite, hold default and slow
    tests both); else a line saying what is wrong and pytest's exit code for it."""
    got = {}
    for path in reports:
        if path.exists():
            r = json.loads(path.read_text())
            got[r["shard"]] = r
    if sorted(got) != list(range(count)):
        print(f"test.sh: shard(s) {sorted(set(range(count)) - set(got))} of {count} never reported what they ran")
        return 1
    collected = {r["collected"] for r in got.values()}
    kept = sum(r["kept"] for r in got.values())
    if len(collected) != 1 or kept != next(iter(collected)):
        print(f"test.sh: the shards ran {kept} tests of {sorted(collected)} collected: they must cover it once")
        return 1
    if kept == 0:
        return pytest.ExitCode.NO_TESTS_COLLECTED
    if full_suite and not all(sum(r[part] for r in got.values()) for part in ("default", "slow")):
        missing = "default" if not sum(r["default"] for r in got.values()) else "slow"
        print(f"dtrain: the whole suite collected no {missing} test (a marker or a conftest that hides them?): a "
              "failure, like pytest's exit 5")  # fmt: skip
        return pytest.ExitCode.NO_TESTS_COLLECTED
    return 0


def durations(logs: list[Path]) -> dict[str, float]:
    """Each test's seconds from the logs of a run (lines 'SECONDS NODEID', as tests/conftest.py writes them)."""
    out: dict[str, float] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            secs, _, node = line.partition(" ")
            if node:
                out[node] = round(float(secs), 2)
    return dict(sorted(out.items()))


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) >= 3:
        return int(check([Path(p) for p in argv[3:]], int(argv[1]), argv[2] == "1"))
    if argv[:1] == ["durations"] and len(argv) >= 2:
        DURATIONS.write_text(json.dumps(durations([Path(p) for p in argv[1:]]), indent=0) + "\n")
        return 0
    print("usage: shards.py check N FULL_SUITE(0|1) REPORT... | shards.py durations LOG...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
