"""Inference images/s of the MNIST model: ONNX Runtime against torch eager, at batch 1 and 256.

    python benchmarks/onnx_vs_torch.py                           # CPU, 7 rounds of 2 s per backend and batch
    python benchmarks/onnx_vs_torch.py --run runs/mnist-...      # a trained run's final weights
    python benchmarks/onnx_vs_torch.py --device cuda --json gpu.json   # GPU (onnxruntime-gpu for ORT's CUDA provider)

Both backends are run the same way: the same model (the ONNX one is dtrain export's, from the same
weights), the same input batches made once up front (float32 host arrays, as a caller holds them),
the same timing loop, the same thread count, and each returns host logits, so a GPU figure counts
the copies both ways for both. A round runs one backend at one batch size for --seconds after a
warm-up; rounds alternate A B, B A so drift (another job on the machine, clocks) falls on both.
The figure is the median of the rounds' images/s, with the range. torch eager is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.evaluate.export import session, to_onnx
from dtrain.mnist.model import MnistNet

WARMUP_S = 0.5


def model(run: str) -> tuple[torch.nn.Module, str]:
    """The network (eval mode): a run's final weights, or a fresh width-16 one (weights do not change
    the arithmetic's cost)."""
    if not run:
        torch.manual_seed(0)
        return MnistNet(16).eval(), "untrained MnistNet(16)"
    from safetensors.torch import load_file

    width = json.loads((Path(run) / "final" / "model.json").read_text())["model_config"]["width"]
    net = MnistNet(width)
    net.load_state_dict(load_file(str(Path(run) / "final" / "model.safetensors")))
    return net.eval(), f"{run} (final weights)"


def torch_backend(net: torch.nn.Module, device: torch.device, layout: str) -> Callable[[np.ndarray], np.ndarray]:
    """torch eager as dtrain evaluates: channels-last by default (dtrain.evaluate.mnist), the batch
    converted on the way in as dtrain's normalisation does."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    net = net.to(device, memory_format=fmt)

    @torch.inference_mode()
    def run(x: np.ndarray) -> np.ndarray:
        return net(torch.from_numpy(x).to(device).contiguous(memory_format=fmt)).cpu().numpy()

    return run


def onnx_backend(onnx_model: bytes, device: torch.device, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    providers = None
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            sys.exit("--device cuda: this onnxruntime has no CUDA provider; pip install onnxruntime-gpu")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sess = session(onnx_model, providers, threads)  # torch gets the same threads (torch.set_num_threads)

    def run(x: np.ndarray) -> np.ndarray:
        return sess.run(["logits"], {"images": x})[0]

    return run


def one_round(fn: Callable[[np.ndarray], np.ndarray], batches: list[np.ndarray], seconds: float) -> float:
    """Images/s over `seconds` of back-to-back calls, after a warm-up; cycling through `batches`."""
    end = time.perf_counter() + WARMUP_S
    i = 0
    while time.perf_counter() < end:
        fn(batches[i % len(batches)])
        i += 1
    images, start = 0, time.perf_counter()
    end = start + seconds
    while True:
        x = batches[i % len(batches)]
        fn(x)
        images += x.shape[0]
        i += 1
        now = time.perf_counter()
        if now >= end:
            return images / (now - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="", help="a run directory whose final model to use (default: untrained weights)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batches", default="1,256", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=7, help="rounds per backend and batch size (median reported)")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per round")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both (default: all cores)")
    p.add_argument("--torch-layout", default="channels_last", choices=["channels_last", "contiguous"])
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be >= 1 and --seconds > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU visible to torch")
    sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    device = torch.device(args.device)

    net, source = model(args.run)
    onnx_model = to_onnx(net, {})
    backends = {
        "torch eager": torch_backend(net, device, args.torch_layout),
        "onnxruntime": onnx_backend(onnx_model, device, threads),
    }
    rng = np.random.default_rng(0)
    inputs = {b: [rng.standard_normal((b, 1, 28, 28), dtype=np.float32) for _ in range(4)] for b in sizes}
    # The two agree before they are timed: this measures the same model.
    diff = max(
        float(np.abs(backends["torch eager"](inputs[b][0]) - backends["onnxruntime"](inputs[b][0])).max())
        for b in sizes
    )

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    load = os.getloadavg()[0]
    print(
        f"model: {source}; device: {gpu or platform.processor() or 'CPU'}; threads: {threads}; torch layout "
        f"{args.torch_layout}; torch {torch.__version__}; load average {load:.1f}; max |logit difference| {diff:.3g}"
    )
    samples: dict[str, dict[int, list[float]]] = {name: {b: [] for b in sizes} for name in backends}
    order = list(backends)
    for r in range(args.rounds):
        for b in sizes:
            for name in order if r % 2 == 0 else reversed(order):
                samples[name][b].append(one_round(backends[name], inputs[b], args.seconds))
    figures: dict[str, Any] = {
        "device": args.device,
        "device_name": gpu or platform.processor(),
        "threads": threads,
        "torch_layout": args.torch_layout,
        "load_average_at_start": load,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "torch": torch.__version__,
        "onnxruntime": __import__("onnxruntime").__version__,
        "max_abs_diff": diff,
        "images_per_s": {},
    }
    print(f"{'batch':>6}  {'torch eager (baseline)':>26}  {'onnxruntime':>26}  {'ort / torch':>11}")
    for b in sizes:
        row = {name: statistics.median(samples[name][b]) for name in backends}
        figures["images_per_s"][str(b)] = {
            name: {"median": row[name], "min": min(samples[name][b]), "max": max(samples[name][b])} for name in backends
        }
        cells = [f"{row[n]:>12,.0f} ({min(samples[n][b]):,.0f}-{max(samples[n][b]):,.0f})".rjust(26) for n in backends]
        print(f"{b:>6}  {cells[0]}  {cells[1]}  {row['onnxruntime'] / row['torch eager']:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
