"""What running a user's own program through dtrain costs, side by side with doing it by hand (issue 20).

    sudo .venv/bin/python benchmarks/user_code.py [--rounds 5] [--only start,sync,ckpt,phases] [--json out.json]

- start: on the two-host test bed (scripts/testbed.py: network namespaces with sshd; needs root), from
  calling `dtrain train first.py --cluster bed --nproc 1` to the script's first line (its import time,
  printed by rank 0), warm (the code and requirements already on both nodes), against plain torchrun
  started by hand over SSH on the same hosts (`ssh h0 torchrun ... first.py & ssh h1 torchrun ...`, the
  same c10d rendezvous), the two alternating round by round so the machine's load falls on both alike.
- phases (not in the default set): where `start`'s dtrain side spends its time, on the same bed, warm: the CLI
  under `strace -f --seccomp-bpf -e trace=execve` (needs strace), each ssh it starts named by what it runs on the
  node (the code tar, the sync, the port check's halves, the agents, ...), printed as start-end seconds from the
  CLI's own start, with rank 0's first line. Figures only; strace adds about 0.1 s.
- sync: dtrain.common.codesync over SSH to one node of the bed, of a 50 MB working directory (60 files of
  random bytes, as data and weights are): the first sync, a second one with nothing changed, and one after
  one file (of 1 MB) changed, each timed from the scan to the node's answer.
- ckpt: steps per second of a user script (a 2-layer MLP, ~2.3 M parameters, saving a 28 MB checkpoint with
  torch.save every --ckpt-every steps) run by `dtrain train` on this machine, with the checkpoint folder
  copied to the run (--checkpoint-dir; the copy interval --ckpt-interval, dtrain's 30 s by default) and
  without (it saves in $DTRAIN_CHECKPOINT_DIR, the run's own folder: nothing to copy), alternating.

The machine's load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]

FIRST = (
    "import time\nT0 = time.time()\nimport os\n"
    "if os.environ.get('RANK') == '0':\n    print(f'FIRST {T0:.3f}', flush=True)\n"
)
CKPT_SCRIPT = """
import os, sys, time, torch
steps, every = int(sys.argv[1]), int(sys.argv[2])
ckpt = sys.argv[3] if len(sys.argv) > 3 else os.environ["DTRAIN_CHECKPOINT_DIR"]
os.makedirs(ckpt, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 128))
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(64, 1024), torch.randn(64, 128)
t0 = time.perf_counter()
for step in range(1, steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step % every == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, os.path.join(ckpt, "ckpt.pt"))
print(f"STEPS_PER_S {steps / (time.perf_counter() - t0):.3f}", flush=True)
"""


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


# ---------------------------------------------------------------------------------------------- start


def bench_start(rounds: int, work: Path, phases: bool = False) -> dict[str, Any]:
    from testbed import Testbed

    bed = Testbed.create(2, work / "bed")
    try:
        kh = bed.write_known_hosts(work / "known_hosts")
        proj = work / "proj"
        proj.mkdir()
        (proj / "first.py").write_text(FIRST)
        (proj / ".gitignore").write_text("xdg/\nruns/\n")
        toml = bed.cluster_toml("bed", sys.executable, known_hosts=str(kh))
        toml = toml.replace("rdzv_port = 29400", "rdzv_port = 29400\nshared_fs = true")  # the bed shares its disk
        (proj / "dtrain.toml").write_text(toml)
        env = {
            **os.environ,
            "XDG_CACHE_HOME": str(work / "xdg"),
            "XDG_CONFIG_HOME": str(work / "xdg"),
            "DTRAIN_OFFLINE": "1",
        }

        def ours() -> float:
            t0 = time.time()
            argv = [*CLI, "train", "first.py", "--cluster", "bed", "--nproc", "1", "--output", str(work / "runs")]
            r = subprocess.run(argv, cwd=proj, env=env, capture_output=True, text=True, timeout=300)
            m = re.search(r"FIRST ([\d.]+)", r.stdout)
            assert r.returncode == 0 and m, r.stdout + r.stderr
            return float(m.group(1)) - t0

        key = str(bed.key)
        master = bed.hosts[0].address

        def by_hand(port: int) -> float:
            t0 = time.time()
            procs = []
            for i, h in enumerate(bed.hosts):
                cmd = (f"cd {proj} && {sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
                       f"--rdzv-backend c10d --rdzv-endpoint {master}:{port} --rdzv-id hand{port} "
                       f"--rdzv-conf is_host={int(i == 0)} --local-addr {h.address} first.py")  # fmt: skip
                argv = ["ssh", "-i", key, "-o", f"UserKnownHostsFile={kh}", "-o", "StrictHostKeyChecking=yes",
                        "-o", "BatchMode=yes", f"root@{h.address}", cmd]  # fmt: skip
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs = [p.communicate(timeout=300)[0] for p in procs]
            m = re.search(r"FIRST ([\d.]+)", "".join(outs))
            assert m, outs
            return float(m.group(1)) - t0

        ours()  # warm: the code and dtrain's node-side code reach the nodes once
        if phases:
            return bench_phases(rounds, work, proj, env)
        a, b = [], []
        for i in range(rounds):
            a.append(ours())
            b.append(by_hand(29500 + i))
            print(f"start round {i + 1}: dtrain {a[-1]:.2f} s, torchrun by hand {b[-1]:.2f} s (load {load()})",
                  flush=True)  # fmt: skip
        return {"dtrain_s": summary(a), "by_hand_s": summary(b),
                "extra_s": summary([x - y for x, y in zip(a, b, strict=True)]), "load": load()}  # fmt: skip
    finally:
        bed.destroy()


# (what an ssh command line runs on a node, matched in order) -> the phase it starts
PHASES = (
    ("-O exit", "close connections"),
    ("nodeagent run", "agents started"),
    ("nodeagent info", "node info"),
    ("--sync-dest", "code sync + requirements + node info"),  # one process since the start overhead work
    ("codesync receive", "code sync"),
    ("deps ensure", "requirements check"),
    ("nodeagent connect", "port check (worker)"),
    ("nodeagent listen", "port check (listener)"),
    ("tar -xzf", "dtrain code to the run"),
    ("true", "connect"),
)


def bench_phases(rounds: int, work: Path, proj: Path, env: dict[str, str]) -> dict[str, Any]:
    """Where `dtrain train` spends its start: the CLI under strace (execve only, through seccomp: cheap),
    each ssh it starts named by the command it runs on the node, timed from the CLI's own start."""
    rows: dict[str, list[float]] = {}
    for i in range(rounds):
        trace = work / f"strace-{i}.txt"
        argv = ["strace", "-f", "--seccomp-bpf", "-ttt", "-s", "600", "-e", "trace=execve", "-o", str(trace),
                *CLI, "train", "first.py", "--cluster", "bed", "--nproc", "1",
                "--output", str(work / "runs")]  # fmt: skip
        t0 = time.time()
        r = subprocess.run(argv, cwd=proj, env=env, capture_output=True, text=True, timeout=300)
        m = re.search(r"FIRST ([\d.]+)", r.stdout)
        assert r.returncode == 0 and m, r.stdout + r.stderr
        first = float(m.group(1)) - t0
        spans: dict[str, list[float]] = {}  # phase -> [first ssh started, last one ended]
        of_pid: dict[str, str] = {}
        for line in trace.read_text().splitlines():
            e = re.match(r"(\d+) +([\d.]+) (?:execve\(\"[^\"]*/ssh\", \[(.*)\]|\+\+\+ exited)", line)
            if not e:
                continue
            pid, at = e.group(1), float(e.group(2)) - t0
            if e.group(3) is None:  # a process ended
                if pid in of_pid:
                    span = spans[of_pid[pid]]
                    span[1] = max(span[1], at)
                continue
            cmd = e.group(3).rsplit('"--", ', 1)[-1]
            phase = next((name for needle, name in PHASES if needle in cmd), "")
            if phase and (phase == "connect" or "-O" not in e.group(3) or phase == "close connections"):
                of_pid[pid] = phase
                spans.setdefault(phase, [at, at])
        spans["first line of rank 0"] = [first, first]
        if "agents started" in spans:  # their ssh live as long as the job
            spans["agents started"][1] = spans["agents started"][0]
        order = sorted(spans.items(), key=lambda kv: kv[1][0])
        print(f"phases round {i + 1} (load {load()}): "
              + ", ".join(f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in order), flush=True)  # fmt: skip
        for k, (a, _b) in spans.items():
            rows.setdefault(k, []).append(a)
    return {k: summary(v) for k, v in sorted(rows.items(), key=lambda kv: statistics.median(kv[1]))}


# ---------------------------------------------------------------------------------------------- sync


def bench_sync(rounds: int, work: Path) -> dict[str, Any]:
    from testbed import Testbed

    from dtrain.common.codesync import scan, send

    bed = Testbed.create(1, work / "bed-sync")
    try:
        kh = bed.write_known_hosts(work / "known_hosts_sync")
        proj = work / "proj50"
        (proj / "data").mkdir(parents=True)
        rng = os.urandom
        for i in range(60):
            (proj / "data" / f"part-{i:02d}.bin").write_bytes(rng(50 * 2**20 // 60))
        (proj / "train.py").write_text("print('hi')\n")
        h = bed.hosts[0]
        dest = h.workdir / "code" / "proj50"
        ssh = ["ssh", "-i", str(bed.key), "-o", f"UserKnownHostsFile={kh}", "-o", "StrictHostKeyChecking=yes",
               "-o", "BatchMode=yes", "-o", "ControlMaster=auto", "-o", f"ControlPath={work}/cm-%C",
               "-o", "ControlPersist=60", f"root@{h.address}"]  # fmt: skip
        subprocess.run([*ssh, "true"], check=True)
        remote = f"PYTHONPATH={REPO}/packages/.. {sys.executable} -m dtrain.common.codesync receive --dest {dest}"

        def once() -> tuple[float, int, int]:
            t0 = time.perf_counter()
            manifest = scan(proj, cache_dir=work / "cache")
            p = subprocess.Popen([*ssh, remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            stats = send(manifest, p.stdout, p.stdin)
            p.stdin.close()
            p.wait()
            return time.perf_counter() - t0, stats.files_sent, stats.bytes_sent

        first = once()
        unchanged, changed = [], []
        for i in range(rounds):
            unchanged.append(once())
            f = proj / "data" / "part-07.bin"
            f.write_bytes(rng(2**20))  # one file changed: 1 MB
            changed.append(once())
            print(f"sync round {i + 1}: unchanged {unchanged[-1][0]:.3f} s ({unchanged[-1][1]} files), one 1 MB file "
                  f"changed {changed[-1][0]:.3f} s ({changed[-1][1]} file, {changed[-1][2]:,} bytes) "
                  f"(load {load()})", flush=True)  # fmt: skip
        return {
            "first_s": round(first[0], 3), "first_files": first[1], "first_bytes": first[2],
            "unchanged_s": summary([u[0] for u in unchanged]), "unchanged_bytes": max(u[2] for u in unchanged),
            "changed_s": summary([c[0] for c in changed]), "changed_bytes": max(c[2] for c in changed),
            "load": load(),
        }  # fmt: skip
    finally:
        bed.destroy()


# ---------------------------------------------------------------------------------------------- ckpt


def bench_ckpt(rounds: int, work: Path, steps: int, interval: float, every: int) -> dict[str, Any]:
    proj = work / "ckptproj"
    proj.mkdir()
    (proj / "bench.py").write_text(CKPT_SCRIPT)
    env = {**os.environ, "DTRAIN_INTERNAL_MIRROR_INTERVAL_S": str(interval), "XDG_CACHE_HOME": str(work / "xdg"),
           "OMP_NUM_THREADS": "1"}  # fmt: skip

    def run(copy: bool) -> float:
        out = str(work / ("runs-copy" if copy else "runs-nocopy"))
        args = ["train", "bench.py", "--nproc", "1", "--output", out]
        tail = [str(steps), str(every)]
        args += ["--checkpoint-dir", "ckpt", "--", *tail, "ckpt"] if copy else ["--", *tail]
        r = subprocess.run([*CLI, *args], cwd=proj, env=env, capture_output=True, text=True, timeout=900)
        m = re.search(r"STEPS_PER_S ([\d.]+)", r.stdout)
        assert r.returncode == 0 and m, r.stdout + r.stderr
        return float(m.group(1))

    on, off = [], []
    for i in range(rounds):
        on.append(run(True))
        off.append(run(False))
        print(f"ckpt round {i + 1}: copy on {on[-1]:.2f} steps/s, off {off[-1]:.2f} steps/s (load {load()})",
              flush=True)  # fmt: skip
    ratio = [a / b for a, b in zip(on, off, strict=True)]
    return {"on_steps_s": summary(on), "off_steps_s": summary(off), "on_over_off": summary(ratio),
            "interval_s": interval, "save_every": every, "steps": steps, "load": load()}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="start,sync,ckpt")
    p.add_argument("--ckpt-steps", type=int, default=300)
    p.add_argument("--ckpt-interval", type=float, default=30.0, help="the copy interval (dtrain's default: 30 s)")
    p.add_argument("--ckpt-every", type=int, default=50, help="the script saves every N steps")
    p.add_argument("--json", default="")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dtrain-user-code-"))
    results: dict[str, Any] = {}
    try:
        for what in a.only.split(","):
            if what in ("start", "phases"):
                results[what] = bench_start(a.rounds, work, phases=what == "phases")
            elif what == "sync":
                results["sync"] = bench_sync(a.rounds, work)
            elif what == "ckpt":
                results["ckpt"] = bench_ckpt(a.rounds, work, a.ckpt_steps, a.ckpt_interval, a.ckpt_every)
            else:
                p.error(f"unknown part {what!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
