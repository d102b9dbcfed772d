"""How old the run's copy of a checkpoint folder is while the job saves every second (issue 30).

    .venv/bin/python benchmarks/mirror_latency.py [--seconds 20] [--period 1.0] [--baseline REV]

A writer process saves a checkpoint every --period seconds in one of four ways, each a common one:
- marked: dtrain's own layout (step-N/state.pt, then step-N/meta.json listing it, then LATEST; the
  newest 3 steps kept), which says when a checkpoint is whole;
- renamed: two files (model.pt, optim.pt), each written to a temporary name and moved into place;
- lone: one file written in place (torch.save(state, "ckpt.pt"));
- pair in place: two files written in place, one after the other.
dtrain.common.mirror's Mirror copies the folder with its own thread at dtrain's default interval (30 s),
to a local store, while the benchmark samples every 0.1 s how old the save in the newest copy is (now
minus the time the writer finished that save). Printed per way: the time to the first copy, the
median and largest age of the copy after it, and the copies made. The same runs with the mirror as
it was at --baseline (default: the commit before the change, read with git), side by side.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = "1dcbb1c"  # main before the checkpoint-copy change
SIZE = 1 << 20  # bytes per checkpoint file
WAYS = ("marked", "renamed", "lone", "pair in place")

WRITER = textwrap.dedent(
    """
    import json, os, shutil, sys, time
    way, root = sys.argv[1], sys.argv[2]
    period, seconds, size = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    os.makedirs(root, exist_ok=True)

    def data(seq, name):
        return (f"{seq}:{name}:".encode()).ljust(size, b"x")

    seq, end = 0, time.time() + seconds
    while time.time() < end:
        seq += 1
        if way == "marked":
            d = os.path.join(root, f"step-{seq:08d}")
            os.makedirs(d)
            with open(os.path.join(d, "state.pt"), "wb") as f:
                f.write(data(seq, "state.pt"))
            with open(os.path.join(d, "meta.json"), "w") as f:
                json.dump({"step": seq, "files": {"state.pt": {"size": size}}}, f)
            with open(os.path.join(root, ".LATEST.tmp"), "w") as f:
                f.write(f"step-{seq:08d}")
            os.replace(os.path.join(root, ".LATEST.tmp"), os.path.join(root, "LATEST"))
            old = os.path.join(root, f"step-{seq - 3:08d}")
            if os.path.isdir(old):
                shutil.rmtree(old)
        else:
            names = ["ckpt.pt"] if way == "lone" else ["model.pt", "optim.pt"]
            for name in names:
                final = os.path.join(root, name)
                target = final + ".tmp" if way == "renamed" else final
                with open(target, "wb") as f:
                    f.write(data(seq, name))
                if way == "renamed":
                    os.replace(target, final)
        print("SAVED", seq, time.time(), flush=True)
        time.sleep(period)
    """
)


def load_mirror(rev: str | None):
    """dtrain.common.mirror as it is here (rev None), or as it was at `rev` (its source from git)."""
    if rev is None:
        from dtrain.common import mirror

        return mirror
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:packages/common/mirror.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="dtrain-mirror-")) / "mirror_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mirror_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mirror_baseline"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def seq_of(way: str, files: dict) -> int:
    """The save a manifest holds: the step for dtrain's layout, else the save whose bytes it has (all of its
    files from the same save, which the benchmark checks: a mixed copy would be a wrong restore)."""
    if way == "marked":
        steps = [int(r.split("/")[0][5:]) for r in files if r.startswith("step-") and r.endswith("/meta.json")]
        return max(steps, default=0)
    seqs = {int(e["seq"]) for e in files.values()}
    if len(seqs) != 1:
        raise AssertionError(f"a copy mixes saves {sorted(seqs)}: {files}")
    return seqs.pop()


def run(way: str, mirror, seconds: float, period: float) -> dict:
    from dtrain.common.storage import open_store

    with tempfile.TemporaryDirectory(prefix="dtrain-mirror-bench-") as tmp:
        local, store = Path(tmp) / "ckpt", open_store(str(Path(tmp) / "run")).child("ckpt")
        local.mkdir()
        saved: dict[int, float] = {}
        shas = {}  # sha256 of a loose file's bytes -> the save that wrote them
        for seq in range(1, int(seconds / period) + 50):
            for name in ("ckpt.pt", "model.pt", "optim.pt"):
                shas[hashlib.sha256((f"{seq}:{name}:".encode()).ljust(SIZE, b"x")).hexdigest()] = seq
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, way, str(local), str(period), str(seconds), str(SIZE)],
            stdout=subprocess.PIPE,
            text=True,
        )

        def read_saves() -> None:
            for line in writer.stdout:  # type: ignore[union-attr]
                _, seq, at = line.split()
                saved[int(seq)] = float(at)

        reader = threading.Thread(target=read_saves, daemon=True)
        reader.start()
        m = mirror.Mirror(local, store, node=0, interval_s=30.0, log=lambda _: None)
        t0 = time.time()
        m.start()
        ages, first, copies, newest = [], None, 0, 0
        try:
            while writer.poll() is None:
                names = sorted(n for n in store.list("node-00000") if n.endswith(".json") and "pending" not in n)
                if names and names[-1] != newest:
                    newest = names[-1]
                    copies += 1
                    files = json.loads(store.read_bytes(newest))["files"]
                    if way != "marked":
                        files = {r: {**e, "seq": shas[e["sha256"]]} for r, e in files.items()}
                    seq = seq_of(way, files)
                    first = first if first is not None else time.time() - t0
                    newest_seq = seq
                if copies and newest_seq in saved:
                    ages.append(time.time() - saved[newest_seq])
                time.sleep(0.1)
        finally:
            m.close(final=False)
            writer.wait()
        return {
            "first_copy_s": first,
            "median_age_s": statistics.median(ages) if ages else None,
            "max_age_s": max(ages) if ages else None,
            "copies": copies,
            "saves": len(saved),
        }


def fmt(v: float | None) -> str:
    return "no copy" if v is None else f"{v:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long each writer saves")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between saves")
    ap.add_argument("--baseline", default=BASELINE, help="the git revision whose mirror.py is the baseline")
    args = ap.parse_args()
    sides = {"now": load_mirror(None), f"at {args.baseline}": load_mirror(args.baseline)}
    print(
        f"writer saves every {args.period:g} s for {args.seconds:g} s, {SIZE // 1024} KiB a file; mirror interval 30 s"
    )
    print(f"{'way':<14} {'mirror':<12} {'first copy s':>12} {'median age s':>13} {'max age s':>10} {'copies':>7}")
    for way in WAYS:
        for side, module in sides.items():
            r = run(way, module, args.seconds, args.period)
            print(
                f"{way:<14} {side:<12} {fmt(r['first_copy_s']):>12} {fmt(r['median_age_s']):>13} "
                f"{fmt(r['max_age_s']):>10} {r['copies']:>7}   ({r['saves']} saves)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
