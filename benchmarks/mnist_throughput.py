"""Images/s and time-to-accuracy on Fashion-MNIST: dtrain's pipeline against the classic recipe.

    python benchmarks/mnist_throughput.py --json out.json    # both, full length: ~10 min on 2 cores
    python benchmarks/mnist_throughput.py --quick              # smoke run, under a minute

"ours" is `dtrain train mnist --dataset fashion-mnist` as a user runs it, default config. "classic"
is the recipe from tutorials and the Kubeflow MNIST example, written out below: a per-sample Python
Dataset, DataLoader(num_workers=4), DistributedSampler, DDP over gloo under torchrun. Both clocks
start when the process is launched, so start-up and data loading count. benchmarks/README.md says
what each figure measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dtrain.mnist import config as mnist_config
from dtrain.mnist.data import MEAN_STD, locate, read_idx

DATASET = mnist_config.Dataset.FASHION_MNIST
QUICK_IMAGES = 2048  # --quick: a training slice that still fills 8 of dtrain's batches of 256
# The classic recipe as the issue ran it. The batch is per process, as in the tutorials.
CLASSIC_WORKERS = 4
CLASSIC_BATCH = 128
CLASSIC_LR = 1e-3
CLASSIC_EVAL_BATCH = 1000
# Settings a benchmark must not inherit from the caller's shell; where the data is may pass.
KEEP_ENV = {"DTRAIN_CACHE_DIR", "DTRAIN_OFFLINE", "DTRAIN_MNIST_DATA_DIR"}
# What each figure is, written into --json next to the figures.
MEASURES = {
    "images_per_s": "training images per second of training-loop time, evaluation excluded "
    "(ours: dtrain's samples_per_s windows that hold no epoch end; classic: the DataLoader loops)",
    "time_to_accuracy": "seconds from launching the pipeline's process to the first per-epoch "
    "evaluation on the 10,000 test images at or above the accuracy; null: never reached",
    "wall_s": "seconds from launch to the process's exit",
}


@dataclasses.dataclass(kw_only=True)
class Result:
    name: str
    command: list[str]
    images_per_s: float
    time_to_accuracy: list[dict[str, Any]]  # [{"accuracy": 0.9, "s": 84.2 or None}], s since launch
    final_accuracy: float
    best_accuracy: float
    wall_s: float
    epochs: list[dict[str, Any]]  # {"epoch", "since_launch_s", "accuracy"}

    def seconds_to(self, target: float) -> float | None:
        return next(t["s"] for t in self.time_to_accuracy if t["accuracy"] == target)


def time_to(evals: list[tuple[float, float]], targets: list[float]) -> list[dict[str, Any]]:
    """evals: (seconds since launch, accuracy) in order -> first time each target was reached."""
    return [{"accuracy": t, "s": next((s for s, acc in evals if acc >= t), None)} for t in targets]


def launch(cmd: list[str], name: str, **kw: Any) -> float:
    """Run `cmd` to the end with its output on our stderr (stdout is for the table); returns the
    wall-clock launch time."""
    print(f"[{name}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.time()
    code = subprocess.run(cmd, stdout=sys.stderr, **kw).returncode
    if code != 0:
        sys.exit(f"error: the {name} run failed (exit {code}); its output is above")
    return t0


# ---------------------------------------------------------------------------------------------
# ours: the dtrain CLI


def run_ours(args: argparse.Namespace, work: Path) -> Result:
    # The console script next to this interpreter, so the benchmark and dtrain share one install.
    exe = Path(sys.executable).with_name("dtrain")
    cmd = [str(exe), "train", "mnist", "--dataset", DATASET.value, "--output", str(work / "runs")]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.epochs_ours:
        cmd += ["--epochs", str(args.epochs_ours)]
    if args.quick:
        cmd += ["--train-split", f"train[:{QUICK_IMAGES}]"]
    cmd += shlex.split(args.ours_args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_") or k in KEEP_ENV}
    # cwd: a dtrain.toml where the benchmark is started must not change the default config.
    t0 = launch(cmd, "ours", cwd=work, env=env)
    wall = time.time() - t0

    (run,) = (work / "runs").iterdir()
    batch = json.loads((run / "config.json").read_text())["config"]["batch_size"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_accuracy" in r]
    eval_steps = [r["step"] for r in evals]
    # Each samples_per_s row covers the steps since the previous row. A window in which an epoch
    # ended also timed that epoch's evaluation and checkpoint, so it is left out of images/s.
    windows, prev = [], 0
    for r in (r for r in rows if "samples_per_s" in r):
        images = (r["step"] - prev) * batch
        windows.append((images, images / r["samples_per_s"], any(prev <= s < r["step"] for s in eval_steps)))
        prev = r["step"]
    clean = [w for w in windows if not w[2]] or windows
    accs = [r["eval_accuracy"] for r in evals]
    return Result(
        name="ours",
        command=cmd,
        images_per_s=sum(w[0] for w in clean) / sum(w[1] for w in clean),
        time_to_accuracy=time_to([(r["time"] - t0, r["eval_accuracy"]) for r in evals], args.targets),
        final_accuracy=accs[-1],
        best_accuracy=max(accs),
        wall_s=wall,
        epochs=[{"epoch": r["epoch"], "since_launch_s": r["time"] - t0, "accuracy": r["eval_accuracy"]} for r in evals],
    )


# ---------------------------------------------------------------------------------------------
# classic: DataLoader workers, per-sample transforms, DistributedSampler (runs under torchrun)


def run_classic(args: argparse.Namespace, work: Path) -> Result:
    rows_path = work / "classic.jsonl"
    n = args.classic_nproc
    threads = max(1, (os.cpu_count() or 1) // n)  # all cores to compute, as dtrain's launcher does
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           __file__, "--worker", "classic", "--rows", str(rows_path), "--threads", str(threads),
           "--epochs-classic", str(args.epochs_classic), "--classic-width", str(args.classic_width)]  # fmt: skip
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    cmd += ["--quick"] if args.quick else []
    t0 = launch(cmd, "classic", env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    wall = time.time() - t0

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    accs = [r["accuracy"] for r in rows]
    return Result(
        name="classic",
        command=cmd,
        images_per_s=sum(r["images"] for r in rows) / sum(r["train_s"] for r in rows),
        time_to_accuracy=time_to([(r["time"] - t0, r["accuracy"]) for r in rows], args.targets),
        final_accuracy=accs[-1],
        best_accuracy=max(accs),
        wall_s=wall,
        epochs=[{"epoch": r["epoch"], "since_launch_s": r["time"] - t0, "accuracy": r["accuracy"]} for r in rows],
    )


class IdxDataset(Dataset):
    """torchvision's FashionMNIST keeps the uint8 images as one tensor and transforms one image per
    __getitem__. torchvision is not installed here, so ToTensor, RandomCrop(28, padding=2) and
    Normalize are written with plain torch ops; torchvision would also convert each image to PIL
    and back, so this baseline is, if anything, faster than the real recipe."""

    def __init__(self, split: str, data_dir: str, limit: int | None, augment: bool) -> None:
        images, labels = locate(DATASET, split, data_dir, download=True)
        self.images, self.labels = read_idx(images)[:limit], read_idx(labels)[:limit]
        self.mean, self.std = MEAN_STD[DATASET]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i].float().div(255).unsqueeze(0)  # ToTensor
        if self.augment:  # RandomCrop(28, padding=2)
            dy, dx = torch.randint(0, 5, (2,)).tolist()
            x = F.pad(x, (2, 2, 2, 2))[:, dy : dy + 28, dx : dx + 28]
        return (x - self.mean) / self.std, int(self.labels[i])  # Normalize


class ClassicNet(nn.Module):
    """Approximates the Kubeflow MNIST example's network as the issue describes it, "4-conv": four
    3x3 conv + ReLU layers (w, w, 2w, 2w channels) with a max-pool after each pair, then two linear
    layers. No batch norm, as in the tutorials."""

    def __init__(self, w: int) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

        self.net = nn.Sequential(
            *conv(1, w), *conv(w, w), nn.MaxPool2d(2), *conv(w, 2 * w), *conv(2 * w, 2 * w), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def classic_worker(args: argparse.Namespace) -> None:
    """One torchrun process of the classic recipe: the tutorial way throughout, not dtrain's."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = open(args.rows, "a") if rank == 0 else None  # noqa: SIM115 - closed below; rank 0 only

    def record(row: dict[str, Any]) -> None:
        if rows is not None:
            rows.write(json.dumps(row) + "\n")
            rows.flush()
            print(f"[classic] epoch {row['epoch']}/{args.epochs_classic}: accuracy {row['accuracy']:.4f}, "
                  f"{row['images'] / row['train_s']:,.0f} images/s",
                  file=sys.stderr, flush=True)  # fmt: skip

    try:
        torch.manual_seed(0)
        train_set = IdxDataset("train", args.data_dir, QUICK_IMAGES if args.quick else None, augment=True)
        test_set = IdxDataset("test", args.data_dir, None, augment=False)
        sampler = DistributedSampler(train_set, seed=0)
        train_loader = DataLoader(train_set, batch_size=CLASSIC_BATCH, sampler=sampler, num_workers=CLASSIC_WORKERS)
        test_loader = DataLoader(
            test_set,
            batch_size=CLASSIC_EVAL_BATCH,
            sampler=DistributedSampler(test_set, shuffle=False),
            num_workers=CLASSIC_WORKERS,
        )
        model = DDP(ClassicNet(args.classic_width))
        opt = torch.optim.AdamW(model.parameters(), lr=CLASSIC_LR)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs_classic)

        for epoch in range(1, args.epochs_classic + 1):
            sampler.set_epoch(epoch)
            model.train()
            start, seen = time.perf_counter(), 0
            for x, y in train_loader:  # the loop's time includes the loader starting its workers
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(y)
            train_s = time.perf_counter() - start
            sched.step()

            model.eval()
            counts = torch.zeros(2)  # correct, seen
            with torch.no_grad():
                for x, y in test_loader:
                    counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
            dist.all_reduce(counts)
            # DistributedSampler pads to equal shards, so with an odd rank count a few test images
            # count twice: dividing by what was counted keeps the figure an accuracy.
            images = seen * world
            record({
                "epoch": epoch,
                "time": time.time(),  # unix seconds; the parent subtracts its launch time
                "accuracy": (counts[0] / counts[1]).item(),
                "images": images,
                "train_s": train_s,
            })  # fmt: skip
    finally:
        if rows is not None:
            rows.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# report


def report(results: list[Result], targets: list[float]) -> None:
    from rich.console import Console
    from rich.table import Table

    pct = [f"{t * 100:g}%" for t in targets]
    table = Table(
        title="Fashion-MNIST on this machine",
        caption="images/s: training throughput, evaluation excluded; "
        "s to N%: seconds from process launch (start-up and data loading included)",
    )
    for col in ["pipeline", "images/s", *(f"s to {p}" for p in pct), "best acc", "final acc", "wall s"]:
        table.add_column(col, justify="left" if col == "pipeline" else "right")
    for r in results:
        tta = [f"{r.seconds_to(t):.0f}" if r.seconds_to(t) is not None else "never" for t in targets]
        table.add_row(
            r.name,
            f"{r.images_per_s:,.0f}",
            *tta,
            f"{r.best_accuracy:.4f}",
            f"{r.final_accuracy:.4f}",
            f"{r.wall_s:.0f}",
        )
    console = Console()
    console.print(table)
    r = ratio(results, targets[0])
    if r is not None:
        console.print(ratio_line(r), highlight=False)


def ratio(results: list[Result], target: float) -> dict[str, Any] | None:
    """Both pipelines' seconds to `target` and classic / ours; None unless both ran."""
    by = {r.name: r for r in results}
    if set(by) != {"ours", "classic"}:
        return None
    c, o = by["classic"].seconds_to(target), by["ours"].seconds_to(target)
    speedup = c / o if c is not None and o is not None else None
    return {"accuracy": target, "classic_s": c, "ours_s": o, "classic_wall_s": by["classic"].wall_s, "speedup": speedup}


def ratio_line(r: dict[str, Any]) -> str:
    head = f"time to {r['accuracy'] * 100:g}% (from launch):"
    c, o = r["classic_s"], r["ours_s"]
    if o is None:
        return f"{head} classic {'never' if c is None else f'{c:.0f} s'} / ours never: no ratio"
    if c is None:  # a lower bound: classic would have needed longer than its whole run
        w = r["classic_wall_s"]
        return f"{head} classic never (ran {w:.0f} s) / ours {o:.0f} s = more than {w / o:.1f}x"
    return f"{head} classic {c:.0f} s / ours {o:.0f} s = {r['speedup']:.1f}x"


def parse_targets(text: str) -> list[float]:
    targets = [float(t) for t in text.split(",") if t.strip()]
    if not targets or not all(0 < t <= 1 for t in targets):
        raise argparse.ArgumentTypeError(f"{text!r}: give accuracies in (0, 1], comma-separated, e.g. 0.90,0.91")
    return targets


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["ours", "classic"], help="run one pipeline only")
    p.add_argument("--epochs-ours", type=int, help="dtrain --epochs (default: dtrain's default)")
    p.add_argument("--epochs-classic", type=int, default=10, help="classic recipe epochs (default 10)")
    p.add_argument("--targets", type=parse_targets, default=[0.90, 0.91], help="accuracies to time (0.90,0.91)")
    p.add_argument("--data-dir", default="", help="directory with the Fashion-MNIST IDX files (both pipelines)")
    p.add_argument("--ours-args", default="", help="more `dtrain train mnist` flags, e.g. '--augment --nproc 1'")
    p.add_argument("--classic-nproc", type=int, default=1, help="classic torchrun processes; threads split the cores")
    p.add_argument("--classic-width", type=int, default=32, help="classic net channels: w-w-2w-2w (default 32)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_IMAGES} training images, 1 epoch each")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    # Internal: the classic recipe re-invokes this file under torchrun.
    p.add_argument("--worker", choices=["classic"], help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("epochs_ours", "epochs_classic", "classic_nproc", "classic_width"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.quick:
        args.epochs_ours = args.epochs_classic = 1

    if args.worker == "classic":
        classic_worker(args)
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="mnist-throughput-") as tmp:
        for name, run in (("ours", run_ours), ("classic", run_classic)):
            if args.only in (None, name):
                (Path(tmp) / name).mkdir()
                results.append(run(args, Path(tmp) / name))
    report(results, args.targets)
    if args.json:
        figures = {
            "dataset": DATASET.value,
            "cpus": os.cpu_count(),
            "quick": args.quick,
            "measures": MEASURES,
            "targets": args.targets,
            "pipelines": {r.name: dataclasses.asdict(r) for r in results},
            "ratio": ratio(results, args.targets[0]),
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
