"""How long the checkpoint a preempted LoRA run saves takes, against GCE's 30 s preemption notice.

    python benchmarks/preempt_save.py [--preset qwen2.5-0.5b-shape] [--steps 2] [--saves 5]
                                      [--gcs start|http://127.0.0.1:PORT] [--json FILE]

It builds the preset's model from its config (random weights: nothing is downloaded), puts LoRA on it
as `dtrain train lora` does (dtrain.lora.model.apply_lora, the workload's defaults: r 8, alpha 16, its
attention and MLP projections), runs --steps AdamW steps on random tokens so the optimizer holds its
moments, then times --saves times the call the workload makes when SIGTERM arrives:
`Checkpointer.save(step, snapshot, last=True)` (dtrain/lora/train.py), which serialises the state and
returns only once the checkpoint is committed (state.pt, meta.json, then LATEST). The snapshot holds
what the workload's holds: the adapter's weights, AdamW's state, the scheduler's and the scaler's.

Where: a local directory, and with --gcs a gs:// bucket on gcp-storage-emulator (`start`: one started
here, in memory, on loopback; or the URL of one that runs). The emulator is loopback HTTP, not Google
Cloud Storage: its figure says what dtrain's own path costs, not what a VM's upload to GCS reaches.

Prints the median (and min/max) seconds of the saves per place and the checkpoint's size in MB. A LoRA
checkpoint is small, so its time is mostly the save's fixed cost; to say how long a state too big for
LoRA would take, the same path also saves a --big-mb state (random fp32: nothing compresses it), and its
MB/s is the rate the estimates use: a 7B model's bf16 weights alone, and a 7B full fine-tune's state
(fp32 weights and AdamW's two moments), against the 30 s notice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NOTICE_S = 30.0  # GCE's preemption notice: SIGTERM, then the VM stops about 30 s later
# What a state too big for LoRA would weigh (decimal MB, as the sizes printed): 7B parameters.
BIG = {
    "7B bf16 weights only": 7e9 * 2 / 1e6,
    "7B full fine-tune state (fp32 weights + AdamW m, v)": 7e9 * 12 / 1e6,
}
EMULATOR_START_S = 30.0


def build(preset: str, steps: int, seq_len: int, seed: int):
    """The preset's model with LoRA, after `steps` AdamW steps, and a snapshot function as the workload's."""
    import torch
    from peft import get_peft_model_state_dict

    from dtrain.lora.model import apply_lora, load_base

    torch.manual_seed(seed)
    base, _tok = load_base(preset, torch.float32, seed)
    model, targets = apply_lora(base, preset, r=8, alpha=16.0, dropout=0.0, targets=[], seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    vocab = model.config.vocab_size
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, min(vocab, 256), (1, seq_len))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    def snapshot() -> dict:
        return {
            "model": get_peft_model_state_dict(model),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": {},
            "precision": "fp32",
            "data": {"epoch": 0, "step_in_epoch": steps},
        }

    total = sum(p.numel() for p in model.parameters())
    return snapshot, total, sum(p.numel() for p in params), targets


def big_state(mb: int):
    """A snapshot function of `mb` MB of random fp32 (as random as weights: torch.save does not compress)."""
    import torch

    tensor = torch.rand(mb * 1_000_000 // 4, generator=torch.Generator().manual_seed(0))
    return lambda: {"model": {"weight": tensor}}


def time_saves(url: str, snapshot, saves: int, first_step: int) -> tuple[list[float], int]:
    """Seconds of each of `saves` SIGTERM-path saves into `url`, and the checkpoint's size in bytes."""
    from dtrain.common.checkpoint import STATE_FILE, Checkpointer, step_dir
    from dtrain.common.dist import distributed
    from dtrain.common.storage import open_store

    store = open_store(url)
    times = []
    with distributed() as d:
        ckpt = Checkpointer(store, d, every=0, keep=2, model_config={"bench": 1}, run_config={"seed": 0},
                            log=lambda _m: None)  # fmt: skip
        try:
            for i in range(saves):
                step = first_step + i
                t0 = time.perf_counter()
                ckpt.save(step, snapshot, last=True)  # what the workload calls once SIGTERM arrived
                times.append(time.perf_counter() - t0)
            size = len(store.read_bytes(f"{step_dir(step)}/{STATE_FILE}"))
        finally:
            ckpt.close()
    return times, size


@contextlib.contextmanager
def emulator(spec: str) -> Iterator[str]:
    """A gcp-storage-emulator endpoint: the one at `spec`, or (spec "start") one started here."""
    if spec != "start":
        yield spec
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="preempt-save-gcs-")
    env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "HOST", "PORT")}
    env["STORAGE_BASE"] = workdir
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
           "--in-memory", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + EMULATOR_START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"gcp-storage-emulator did not start on :{port}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def make_bucket(endpoint: str, name: str) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="dtrain-bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})  # fmt: skip
    if client.lookup_bucket(name) is None:
        client.create_bucket(name)


def summary(where: str, times: list[float], size: int) -> dict:
    mb = size / 1e6
    median = statistics.median(times)
    return {"where": where, "saves": len(times), "median_s": median, "min_s": min(times), "max_s": max(times),
            "mb": mb, "mb_per_s": mb / median if median > 0 else float("inf")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b-shape", help="a dtrain.lora preset (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=2, help="training steps before the saves (default: %(default)s)")
    ap.add_argument("--saves", type=int, default=5, help="saves timed per place (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per training step (default: %(default)s)")
    ap.add_argument("--big-mb", type=int, default=512, help="the state that measures MB/s (default: %(default)s)")
    ap.add_argument("--gcs", default="", help='"start" (an emulator started here) or a running emulator\'s URL')
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.saves < 1 or args.big_mb < 1:
        ap.error("--steps, --saves and --big-mb must be at least 1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # one process, not under torchrun
        os.environ.pop(k, None)
    os.environ.setdefault("DTRAIN_OFFLINE", "1")

    t0 = time.perf_counter()
    snapshot, total, trainable, targets = build(args.preset, args.steps, args.seq_len, seed=0)
    built = time.perf_counter() - t0
    print(f"preset {args.preset}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable "
          f"(LoRA r=8 on {', '.join(targets)}); built and {args.steps} steps in {built:.1f} s")  # fmt: skip
    big = big_state(args.big_mb)

    results, rates = [], []
    for where in ["local"] + (["gs (emulator)"] if args.gcs else []):
        with contextlib.ExitStack() as stack:
            if where == "local":
                url = str(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="preempt-save-"))) / "ckpt")
            else:
                endpoint = stack.enter_context(emulator(args.gcs))
                os.environ["STORAGE_EMULATOR_HOST"] = endpoint
                make_bucket(endpoint, "preempt-save")
                url = "gs://preempt-save/run/checkpoints"
            times, size = time_saves(url, snapshot, args.saves, args.steps + 1)
            results.append(summary(where, times, size))
            times, size = time_saves(url + "-big", big, args.saves, 1)
            rates.append(summary(where, times, size))

    for r in results:
        print(f"save {r['where']}: median {r['median_s']:.3f} s of {r['saves']} (min {r['min_s']:.3f}, "
              f"max {r['max_s']:.3f}); checkpoint {r['mb']:.2f} MB; "
              f"{100 * r['median_s'] / NOTICE_S:.2f}% of the {NOTICE_S:.0f} s notice")  # fmt: skip
    estimates = []
    for r in rates:
        print(f"rate {r['where']}: a {r['mb']:.0f} MB state saved in median {r['median_s']:.3f} s of "
              f"{r['saves']}: {r['mb_per_s']:.1f} MB/s")  # fmt: skip
        for what, mb in BIG.items():
            seconds = mb / r["mb_per_s"]
            fits = "fits" if seconds <= NOTICE_S else "does NOT fit"
            estimates.append({"where": r["where"], "state": what, "mb": mb, "seconds": seconds,
                              "fits": seconds <= NOTICE_S})  # fmt: skip
            print(f"estimate {r['where']}: {what}, {mb / 1000:.1f} GB at {r['mb_per_s']:.1f} MB/s: "
                  f"{seconds:.0f} s, {fits} in the {NOTICE_S:.0f} s notice")  # fmt: skip
    if args.json:
        figures = {"preset": args.preset, "parameters": total, "trainable": trainable, "saves": results,
                   "rates": rates, "estimates": estimates}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
