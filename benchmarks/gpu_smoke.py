"""GPU smoke checks: what only a GPU can show about dtrain, one line per check.

    python benchmarks/gpu_smoke.py                 # on a GPU machine: every check
    python benchmarks/gpu_smoke.py --cpu           # on a CPU: the same code, where it applies
    python benchmarks/gpu_smoke.py --only sdpa-gqa,fused-linear

Each line reads `PASS|FAIL|SKIP <check>: <figures or reason>`; the exit code is 1 if any check
failed. On a GPU it runs MNIST and LoRA for a few steps in each precision the GPU has, the nccl
all-reduce check, the LoRA benchmark in bf16, and the checks that the review of the GPU paths
(docs/gpu.md) could not make on a CPU: no host sync in an fp16 MNIST step, cuDNN's autotuner for
MNIST, no math-backend attention for grouped heads, TF32 for fp32 products, no fused LoRA linear on
CUDA, a few syncs per LoRA evaluation rather than two a batch, a precision change on resume, weights
read straight onto the GPU, no RNG-fork warning with several GPUs; and the memory paths of LoRA: activation
checkpointing's peak memory, QLoRA (NF4) in process and through the CLI with a bf16 merge, FSDP2
sharding through the CLI (issue 21). `--cpu` (the default without a
GPU) runs the checks that have a CPU form, so this script is exercised by the tests on machines
without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
# A few steps: enough to see the loss move and every code path of a step run, not a benchmark.
MNIST_IMAGES, MNIST_BATCH = 1024, 64
LORA_STEPS, LORA_SEQ, LORA_BATCH = 6, 128, 4
SUBPROCESS_TIMEOUT_S = 900


class Skip(Exception):
    """The check does not apply here (no GPU, no bf16, one GPU); the message says why."""


class Failed(Exception):
    """The check ran and found the defect it looks for."""


class Env:
    """What the checks share: the device, the precisions it has, a scratch directory, made data."""

    def __init__(self, cpu: bool, work: Path) -> None:
        self.cuda = torch.cuda.is_available() and not cpu
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.work = work
        bf16 = self.cuda and torch.cuda.is_bf16_supported(including_emulation=False)
        # fp16 on a CPU is refused by dtrain (and slow there); bf16 on a CPU is allowed but takes
        # seconds a LoRA step: the CPU form runs fp32 only.
        self.precisions = ["fp32", *(["bf16"] if bf16 else []), *(["fp16"] if self.cuda else [])]
        self.has_bf16 = bf16
        self._mnist: Path | None = None
        self._text: Path | None = None

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skip("needs a CUDA GPU")

    def mnist_dir(self) -> Path:
        """Four IDX files of random images and labels (no dataset is downloaded)."""
        if self._mnist is None:
            d = self.work / "mnist"
            d.mkdir()
            rng = random.Random(0)
            for split, n in (("train", MNIST_IMAGES), ("t10k", MNIST_IMAGES // 4)):
                images = bytes(rng.randrange(256) for _ in range(n * 28 * 28))
                labels = bytes(rng.randrange(10) for _ in range(n))
                for kind, dims, data in (("images-idx3", (n, 28, 28), images), ("labels-idx1", (n,), labels)):
                    header = bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)
                    (d / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + data, mtime=0))
            self._mnist = d
        return self._mnist

    def text(self) -> Path:
        """Real text: a few of Python's own modules."""
        if self._text is None:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            self._text = self.work / "corpus.txt"
            self._text.write_text("".join((stdlib / m).read_text() for m in ("textwrap.py", "string.py", "shutil.py")))
        return self._text


def dtrain(env: Env, *args: str, cwd: Path, log_every: int = 2) -> subprocess.CompletedProcess:
    """The dtrain CLI next to this interpreter, offline, one process, a metrics row every `log_every`."""
    cwd.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("dtrain")
    cmd = [str(exe), *args, "--nproc", "1", "--output", str(cwd / "runs")]
    e = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    # Settings the CLI takes from the environment only; the evaluation capped, it is not what is checked.
    e |= {"DTRAIN_OFFLINE": "1", "DTRAIN_LOG_EVERY": str(log_every), "DTRAIN_LORA_EVAL_BATCHES": "2"}
    if not env.cuda:
        e["CUDA_VISIBLE_DEVICES"] = ""  # --cpu on a GPU machine: the runs too
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def run_rows(cwd: Path) -> tuple[Path, list[dict[str, Any]]]:
    (run,) = (cwd / "runs").iterdir()
    return run, [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def last_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit {p.returncode}"


# ---------------------------------------------------------------------------------------------
# the checks


def check_mnist(env: Env, precision: str) -> str:
    if precision not in env.precisions:
        raise Skip(f"no {precision} on this device")
    cwd = env.work / f"mnist-{precision}"
    t0 = time.perf_counter()
    p = dtrain(env, "train", "mnist", "--data-dir", str(env.mnist_dir()), "--epochs", "1", "--batch-size",
               str(MNIST_BATCH), "--precision", precision, cwd=cwd, log_every=4)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    _, rows = run_rows(cwd)
    losses = [r["loss"] for r in rows if "loss" in r]
    (ev,) = [r for r in rows if "eval_accuracy" in r]
    if not losses or not all(math.isfinite(v) for v in losses):
        raise Failed(f"losses {losses}")
    return (
        f"{MNIST_IMAGES // MNIST_BATCH} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval accuracy "
        f"{ev['eval_accuracy']:.3f} (random labels), {time.perf_counter() - t0:.0f} s with start-up"
    )


def check_lora(env: Env, precision: str) -> str:
    if precision not in env.precisions:
        raise Skip(f"no {precision} on this device")
    cwd = env.work / f"lora-{precision}"
    t0 = time.perf_counter()
    p = dtrain(env, "train", "lora", "--model", "tiny-llama", "--data", str(env.text()), "--max-steps",
               str(LORA_STEPS), "--seq-len", str(LORA_SEQ), "--batch-size", str(LORA_BATCH), "--lr", "2e-3",
               "--precision", precision, cwd=cwd)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    _, rows = run_rows(cwd)
    losses = [r["loss"] for r in rows if "loss" in r]
    ppl = [r["eval_perplexity"] for r in rows if "eval_perplexity" in r]
    if not all(math.isfinite(v) for v in losses) or not ppl[-1] < ppl[0]:
        raise Failed(f"losses {losses}, eval perplexity {ppl}")
    return (
        f"{LORA_STEPS} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval perplexity {ppl[0]:.1f} -> "
        f"{ppl[-1]:.1f}, {time.perf_counter() - t0:.0f} s with start-up"
    )


def check_allreduce(env: Env) -> str:
    """dtrain doctor's all-reduce: nccl over every GPU here (gloo over 2 processes on a CPU)."""
    from dtrain.common.allreduce_check import RESULT_PREFIX

    n = torch.cuda.device_count() if env.cuda else 2
    cmd = [sys.executable, "-m", "dtrain.common.launch", "--nnodes", "1", "--nproc-per-node", str(n),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "dtrain.common.allreduce_check",
           "--mib", "64" if env.cuda else "8"]  # fmt: skip
    e = os.environ | ({} if env.cuda else {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=e)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not lines:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    r = json.loads(lines[0][len(RESULT_PREFIX) :])
    if not r["correct"] or r["backend"] != ("nccl" if env.cuda else "gloo"):
        raise Failed(str(r))
    return f"{r['backend']}, {r['world_size']} rank(s), {r['mib']:g} MiB: {r['ms']} ms, bus {r['busbw_gbps']} GB/s"


def check_lora_benchmark(env: Env) -> str:
    """benchmarks/lora_throughput.py: on a GPU the issue's setting in bf16 (ours and the packed
    Trainer); on a CPU its quick mode, ours alone in fp32."""
    if env.cuda and not env.has_bf16:
        raise Skip("no bf16 on this GPU (a T4): run lora_throughput.py, which picks fp16 there")
    out = env.work / "lora_throughput.json"
    if env.cuda:
        args = ["--model", "qwen2.5-0.5b-shape", "--seq-len", "1024", "--precision", "bf16",
                "--only", "ours,trainer-packed", "--steps", "30", "--warmup-steps", "10"]  # fmt: skip
    else:
        args = ["--quick", "--only", "ours", "--precision", "fp32"]
    p = subprocess.run([sys.executable, str(HERE / "lora_throughput.py"), *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    figures = json.loads(out.read_text())
    pipes = figures["pipelines"]
    parts = [f"{name} {r['tokens_per_s']:,.0f} tokens/s" + (f", MFU {r['mfu']:.1%}" if r["mfu"] else "")
             for name, r in pipes.items()]  # fmt: skip
    ratio = figures["ratios"]["ours_over_packed"]
    return (
        f"{figures['model']} {figures['settings']['precision']}: "
        + "; ".join(parts)
        + (f"; ours / trainer-packed {ratio:.2f}x" if ratio else "")
    )


def check_mnist_step_syncs(env: Env) -> str:
    """An fp16 MNIST step (dtrain's train_step and optimizer, GradScaler on) must not make the host
    wait for the GPU: torch's sync debug mode turns any such wait into an error."""
    env.need_cuda()
    from dtrain.common.config import Precision
    from dtrain.common.precision import PrecisionPolicy
    from dtrain.mnist.config import MnistConfig
    from dtrain.mnist.model import MnistNet
    from dtrain.mnist.train import Normalize, make_optimizer, train_step

    policy = PrecisionPolicy(Precision.FP16, env.device, "smoke")
    net = MnistNet(16).to(env.device, memory_format=torch.channels_last)
    opt = make_optimizer(net, MnistConfig(), env.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler, ctx = policy.make_scaler(), SimpleNamespace(precision=policy)
    x = Normalize(0.13, 0.31)(torch.randint(0, 256, (MNIST_BATCH, 28, 28), dtype=torch.uint8, device=env.device))
    y = torch.randint(0, 10, (MNIST_BATCH,), device=env.device)
    for _ in range(3):  # warm: cuDNN's choices, the allocator, the fused kernel's first launch
        train_step(ctx, net, opt, sched, scaler, x, y, 0.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            loss = train_step(ctx, net, opt, sched, scaler, x, y, 0.0)
    except RuntimeError as e:
        raise Failed(f"a step waited for the GPU: {str(e).splitlines()[0][:200]}") from None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return f"5 fp16 steps, no host sync (fused AdamW: {opt.defaults.get('fused')}); loss {loss.item():.3f}"


def check_mnist_cudnn_benchmark(env: Env) -> str:
    """MNIST's fixed shapes with cuDNN's autotuner (dtrain sets cudnn.benchmark on CUDA): fp32
    steps timed with it off, then on; on should not be slower."""
    env.need_cuda()
    from dtrain.common.config import Precision
    from dtrain.common.precision import PrecisionPolicy
    from dtrain.mnist.config import MnistConfig
    from dtrain.mnist.model import MnistNet
    from dtrain.mnist.train import Normalize, make_optimizer, train_step

    policy = PrecisionPolicy(Precision.FP32, env.device, "smoke")
    ctx = SimpleNamespace(precision=policy)
    x = Normalize(0.13, 0.31)(torch.randint(0, 256, (256, 28, 28), dtype=torch.uint8, device=env.device))
    y = torch.randint(0, 10, (256,), device=env.device)
    ms = {}
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        net = MnistNet(16).to(env.device, memory_format=torch.channels_last)
        opt = make_optimizer(net, MnistConfig(), env.device)
        sched, scaler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), policy.make_scaler()
        for _ in range(10):  # the autotuner's trials happen here
            train_step(ctx, net, opt, sched, scaler, x, y, 0.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            train_step(ctx, net, opt, sched, scaler, x, y, 0.0)
        torch.cuda.synchronize()
        ms[benchmark] = (time.perf_counter() - t0) * 10
    torch.backends.cudnn.benchmark = False
    line = f"batch 256 fp32: {ms[False]:.2f} ms/step without cudnn.benchmark, {ms[True]:.2f} with"
    if ms[True] > 1.1 * ms[False]:
        raise Failed(line)
    return line


def _qwen_attention_model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Two layers of qwen2.5-0.5b-shape's attention geometry (14 query, 2 key/value heads of 64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtrain.lora.fused import fuse_model
    from dtrain.lora.model import apply_lora

    config = AutoConfig.for_model("qwen2", vocab_size=258, hidden_size=896, intermediate_size=1024,
                                  num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model, _ = apply_lora(model.to(device), "qwen2", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    fuse_model(model)
    return model


def check_sdpa_gqa(env: Env) -> str:
    """Grouped-query attention's SDPA backend in each precision, as torch's dispatcher picks it for
    the calls the patched attention makes: never the math backend (memory quadratic in T)."""
    from torch.nn.attention import SDPBackend

    stock, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        seen.append((SDPBackend(choice).name, q.shape[1], k.shape[1]))
        return stock(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    results = []
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        for precision in env.precisions:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
            model = _qwen_attention_model(env.device, torch.float32)
            x = torch.randint(0, 256, (1, 1024 if env.cuda else 256), device=env.device)
            seen.clear()
            with torch.autocast(env.device.type, dtype=dtype, enabled=precision != "fp32"):
                model(input_ids=x, labels=x, use_cache=False).loss.backward()
            backends = {b for b, _, _ in seen}
            results.append(f"{precision} {'/'.join(sorted(backends))} ({seen[0][1]}q/{seen[0][2]}kv heads)")
            if "MATH" in backends:
                raise Failed(", ".join(results))
    finally:
        torch.nn.functional.scaled_dot_product_attention = stock
    return ", ".join(results)


def check_tf32(env: Env) -> str:
    """fp32 products on CUDA after dtrain's PrecisionPolicy.configure(): TF32 on Ampere and later."""
    env.need_cuda()
    from dtrain.common.config import Precision
    from dtrain.common.precision import resolve_precision

    a = torch.randn(8192, 8192, device=env.device)

    def tflops() -> float:
        a @ a
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        return 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12

    before = torch.backends.cuda.matmul.fp32_precision
    ieee = tflops()
    resolve_precision(Precision.FP32, env.device).configure()
    tf32 = tflops()
    torch.backends.cuda.matmul.fp32_precision = before
    line = f"fp32 8192^3 product: {ieee:.1f} TFLOP/s IEEE, {tf32:.1f} with dtrain's setting"
    if torch.cuda.get_device_capability(env.device) >= (8, 0) and tf32 < 1.5 * ieee:
        raise Failed(line + " (TF32 should be several times faster on sm 8.0+)")
    return line


def check_fused_linear(env: Env) -> str:
    """The fused LoRA linear runs on the CPU (oneDNN) and never on CUDA, where it kept a second copy
    of every adapted weight for the backward."""
    from dtrain.lora.fused import fuse_model
    from dtrain.lora.model import apply_lora, load_base

    model, _ = load_base("tiny-llama", torch.float32, seed=0, device=env.device)
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    fuse_model(model)
    x = torch.randint(0, 256, (8, 256), device=env.device)
    if env.cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    seen, todo, nodes = set(), [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            nodes.add(type(fn).__name__)
            todo.extend(f for f, _ in fn.next_functions)
    loss.backward()
    fused = "LoraLinearFnBackward" in nodes
    if fused == env.cuda:
        raise Failed(f"fused LoRA linear {'used' if fused else 'not used'} on {env.device.type}")
    peak = f", peak {torch.cuda.max_memory_allocated(env.device) / 2**20:,.0f} MiB" if env.cuda else ""
    return f"fused LoRA linear {'used' if fused else 'not used'} on {env.device.type} (tiny-llama fp32, 8x256){peak}"


def check_lora_eval_syncs(env: Env) -> str:
    """dtrain.lora.train.evaluate over 8 batches: the host waits for the GPU a fixed few times (the
    copy of the blocks, the result), not per batch."""
    env.need_cuda()
    from dtrain.common.config import Precision
    from dtrain.common.precision import PrecisionPolicy
    from dtrain.lora.model import apply_lora, load_base
    from dtrain.lora.train import evaluate

    model, _ = load_base("tiny-llama", torch.bfloat16 if env.has_bf16 else torch.float16, seed=0, device=env.device)
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    mode = Precision.BF16 if env.has_bf16 else Precision.FP16
    ctx = SimpleNamespace(d=SimpleNamespace(rank=0, world_size=1, device=env.device, backend=None),
                          precision=PrecisionPolicy(mode, env.device, "smoke"))  # fmt: skip
    blocks = torch.randint(0, 256, (32, 128))
    evaluate(ctx, model, blocks, 4, 0)  # warm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = evaluate(ctx, model, blocks, 4, 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    if len(syncs) > 3:
        raise Failed(f"{len(syncs)} host syncs for 8 batches")
    return f"8 batches, {len(syncs)} host syncs; eval loss {result['eval_loss']:.3f}"


def check_resume_precision(env: Env) -> str:
    """A bf16 checkpoint resumed in fp16 (an L4's run continued on a T4): it continues, and says so."""
    env.need_cuda()
    if not env.has_bf16:
        raise Skip("needs a GPU with both bf16 and fp16")
    cwd = env.work / "resume"
    base = ["train", "lora", "--model", "tiny-llama", "--data", str(env.text()), "--seq-len", str(LORA_SEQ),
            "--batch-size", str(LORA_BATCH)]  # fmt: skip
    first = dtrain(env, *base, "--max-steps", "4", "--precision", "bf16", cwd=cwd)
    if first.returncode != 0:
        raise Failed(f"bf16 run: exit {first.returncode}: {last_line(first)}")
    run, _ = run_rows(cwd)
    resumed = dtrain(env, "train", "lora", "--resume", run.name, "--max-steps", "8", "--precision", "fp16", cwd=cwd)
    if resumed.returncode != 0:
        raise Failed(f"fp16 resume: exit {resumed.returncode}: {last_line(resumed)}")
    _, rows = run_rows(cwd)
    events = [r["message"] for r in rows if r.get("event") == "precision"]
    if len(events) != 1:
        raise Failed(f"events {events}")
    return events[0]


# A Llama of about 0.5B parameters (1 GB in bf16) and a word-level tokenizer, saved as transformers saves them.
MAKE_MODEL_DIR = """
import sys, torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(sys.argv[1])
"""


def check_load_to_device(env: Env) -> str:
    """A model directory read with dtrain's load_base lands on the GPU without passing through host
    memory as a whole model (transformers' device map); every weight ends on the GPU."""
    env.need_cuda()
    import resource

    from dtrain.lora.model import load_base

    d = env.work / "model-dir"
    # Written by a child process, so that this one's peak memory is only what loading takes.
    subprocess.run([sys.executable, "-c", MAKE_MODEL_DIR, str(d)], check=True, timeout=SUBPROCESS_TIMEOUT_S)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, _ = load_base(str(d), torch.bfloat16, seed=0, device=env.device)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    devices = {p.device.type for p in model.parameters()}
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if devices != {"cuda"}:
        raise Failed(f"weights on {devices}")
    return f"{size:,.0f} MiB of weights on the GPU; peak host RSS grew {rss1 - rss0:,.0f} MiB while loading"


def check_fork_rng(env: Env) -> str:
    """On a machine with several GPUs, building a preset and its LoRA forks the CPU generator only:
    no warning (and no context made on every GPU)."""
    env.need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip("one GPU: torch warns only with several")
    from dtrain.lora.model import apply_lora, load_base

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_base("tiny-llama", torch.float32, seed=0, device=env.device)
        apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    forks = [str(w.message)[:120] for w in caught if "fork_rng" in str(w.message)]
    if forks:
        raise Failed(forks[0])
    return f"{torch.cuda.device_count()} GPUs, no fork_rng warning"


def _text_blocks(env: Env, n: int) -> torch.Tensor:
    """`n` blocks of LORA_SEQ byte tokens of the smoke corpus (real text), on the CPU."""
    data = env.text().read_bytes()[: n * LORA_SEQ]
    return torch.tensor(list(data), dtype=torch.long).view(n, LORA_SEQ)


def check_activation_checkpointing(env: Env) -> str:
    """dtrain's activation checkpointing on tiny-llama in the GPU's half precision, 4 x 1024 tokens:
    the step's peak memory falls, the LoRA gradients stay (the recomputation is the same arithmetic)."""
    env.need_cuda()
    from dtrain.lora.model import apply_lora, enable_activation_checkpointing, load_base

    dtype = torch.bfloat16 if env.has_bf16 else torch.float16
    x = torch.randint(0, 256, (4, 1024), generator=torch.Generator().manual_seed(0)).to(env.device)
    peaks, grads = {}, {}
    for on in (False, True):
        model, _ = load_base("tiny-llama", dtype, seed=0, device=env.device)
        model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
        if on:
            enable_activation_checkpointing(model)
        model.train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(env.device)
        base = torch.cuda.memory_allocated(env.device)
        with torch.autocast("cuda", dtype=dtype):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks[on] = (torch.cuda.max_memory_allocated(env.device) - base) / 2**20
        grads[on] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        del model, loss
        torch.cuda.empty_cache()
    diff = ((grads[True] - grads[False]).norm() / grads[False].norm()).item()
    line = (
        f"{str(dtype)[6:]} 4x1024: step peak {peaks[False]:,.0f} MiB without, {peaks[True]:,.0f} MiB with; "
        f"LoRA gradients' relative difference {diff:.1e}"
    )
    if not peaks[True] < 0.7 * peaks[False] or diff > 1e-2:
        raise Failed(line)
    return line


def check_qlora(env: Env) -> str:
    """QLoRA in process, tiny-llama: NF4 with double quantization through dtrain's loader, peft's k-bit
    preparation, LoRA and activation checkpointing; steps in the GPU's compute dtype (bf16 on sm 8.0+,
    fp16 with loss scaling before); the adapter saved, then loaded with stock peft onto a fresh 4-bit
    base, gives the trained model's logits."""
    env.need_cuda()
    from peft import PeftModel

    from dtrain.lora import quant
    from dtrain.lora.model import apply_lora, enable_activation_checkpointing, load_base

    compute = quant.compute_dtype(env.device)

    def base() -> torch.nn.Module:
        return load_base("tiny-llama", compute, seed=0, device=env.device, quantization=quant.nf4_config(compute))[0]

    torch.cuda.reset_peak_memory_stats(env.device)
    model = quant.prepare(base())
    q = model.model.layers[0].self_attn.q_proj
    state = getattr(q.weight, "quant_state", None)
    if type(q).__name__ != "Linear4bit" or state is None or state.quant_type != "nf4" or not state.nested:
        raise Failed(f"q_proj is {type(q).__name__}, quant state {state}")
    model, _ = apply_lora(model, "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    enable_activation_checkpointing(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=compute == torch.float16)
    blocks = _text_blocks(env, 8 * LORA_BATCH).to(env.device)
    model.train()
    losses = []
    for i in range(2 * LORA_STEPS):
        x = blocks[(i % 8) * LORA_BATCH : (i % 8 + 1) * LORA_BATCH]
        with torch.autocast("cuda", dtype=compute):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(env.device) / 2**20
    if not all(math.isfinite(v) for v in losses) or not losses[-1] < losses[0]:
        raise Failed(f"losses {losses}")
    path = env.work / "qlora-adapter"
    model.save_pretrained(str(path))
    model.eval()
    reloaded = PeftModel.from_pretrained(base(), str(path)).eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=compute):
        want, got = model(input_ids=blocks[:2]).logits.float(), reloaded(input_ids=blocks[:2]).logits.float()
    rel = ((want - got).abs().max() / want.abs().max()).item()
    if not math.isfinite(rel) or rel > 0.05:
        raise Failed(f"reloaded adapter's logits differ by {rel:.2%}")
    return (
        f"NF4 + double quant, compute {str(compute)[6:]}, {len(losses)} steps, loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}, peak {peak:,.0f} MiB; stock peft reload: logits within {rel:.1%}"
    )


def check_lora_qlora_run(env: Env) -> str:
    """`dtrain train lora --quant 4bit --merge` end to end: trains, writes a stock PEFT adapter and a
    bf16 merged model that transformers loads."""
    env.need_cuda()
    from transformers import AutoModelForCausalLM

    cwd = env.work / "lora-qlora"
    p = dtrain(env, "train", "lora", "--model", "tiny-llama", "--data", str(env.text()), "--max-steps",
               str(LORA_STEPS), "--seq-len", str(LORA_SEQ), "--batch-size", str(LORA_BATCH), "--lr", "2e-3",
               "--quant", "4bit", "--merge", cwd=cwd)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    if "QLoRA (NF4 base)" not in p.stdout:
        raise Failed("the run did not say it loaded a 4-bit base")
    run, rows = run_rows(cwd)
    ppl = [r["eval_perplexity"] for r in rows if "eval_perplexity" in r]
    if not ppl[-1] < ppl[0]:
        raise Failed(f"eval perplexity {ppl}")
    adapter = json.loads((run / "final" / "adapter" / "adapter_config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(str(run / "final" / "merged"))
    dtypes = {p.dtype for p in merged.parameters()}
    if adapter.get("peft_type") != "LORA" or dtypes != {torch.bfloat16}:
        raise Failed(f"adapter {adapter.get('peft_type')}, merged dtypes {dtypes}")
    return f"{LORA_STEPS} steps, eval perplexity {ppl[0]:.1f} -> {ppl[-1]:.1f}; PEFT adapter, bf16 merged model"


def check_lora_fsdp(env: Env) -> str:
    """`dtrain train lora --sharding fsdp --merge` on the GPU(s): FSDP2 with the base in half precision
    and the LoRA weights in fp32 in the same units; the adapter loads with stock peft."""
    env.need_cuda()
    from peft import PeftModel

    from dtrain.lora.model import load_base

    cwd = env.work / "lora-fsdp"
    p = dtrain(env, "train", "lora", "--model", "tiny-llama", "--data", str(env.text()), "--max-steps",
               str(LORA_STEPS), "--seq-len", str(LORA_SEQ), "--batch-size", str(LORA_BATCH), "--lr", "2e-3",
               "--sharding", "fsdp", "--merge", "--checkpoint-every", "3", cwd=cwd)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    sharded = "FSDP2 sharded" in p.stdout
    run, rows = run_rows(cwd)
    ppl = [r["eval_perplexity"] for r in rows if "eval_perplexity" in r]
    if not ppl[-1] < ppl[0]:
        raise Failed(f"eval perplexity {ppl}")
    base, _ = load_base("tiny-llama", torch.float32, seed=0)
    model = PeftModel.from_pretrained(base, str(run / "final" / "adapter"))
    n = sum(1 for name, _ in model.named_parameters() if "lora_" in name)
    if n != 56:
        raise Failed(f"{n} LoRA tensors loaded")
    return (
        f"{LORA_STEPS} steps ({'sharded' if sharded else 'one process: not sharded'}), eval perplexity "
        f"{ppl[0]:.1f} -> {ppl[-1]:.1f}; adapter loads with stock peft"
    )


def check_qlora_fsdp(env: Env) -> str:
    """QLoRA sharded with FSDP2 (`--quant 4bit --sharding fsdp`). In process, one rank: the 4-bit
    base read into host memory as the sharded run reads it, fully_shard moving its packed uint8 weights
    to the GPU and dtrain placing the quantization constants there (dtrain.lora.sharding.shard); steps
    in the compute dtype give the losses of the same model unsharded on the GPU (quantized there). With
    two or more GPUs, also the CLI run on two of them: sharded, the adapter loads with stock peft."""
    env.need_cuda()
    from dtrain.lora import quant, sharding
    from dtrain.lora.model import apply_lora, enable_activation_checkpointing, load_base

    compute = quant.compute_dtype(env.device)
    blocks = _text_blocks(env, 4 * LORA_BATCH).to(env.device)

    def steps(where: torch.device | None, shard: bool) -> list[float]:
        model, _ = load_base("tiny-llama", compute, seed=0, device=where, quantization=quant.nf4_config(compute))
        model, _ = apply_lora(quant.prepare(model), "tiny-llama", r=8, alpha=16, dropout=0.0, targets=[], seed=0)
        enable_activation_checkpointing(model)
        if shard:
            sharding.shard(model, SimpleNamespace(device=env.device, world_size=1))
            if not sharding.is_sharded(model):
                raise Failed("fully_shard did not wrap the model")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        scaler = sharding.grad_scaler(torch.amp.GradScaler("cuda", enabled=compute == torch.float16), shard)
        out = []
        for i in range(4):
            x = blocks[i * LORA_BATCH : (i + 1) * LORA_BATCH]
            with torch.autocast("cuda", dtype=compute):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=env.device)
    try:
        got = steps(None, shard=True)
    finally:
        dist.destroy_process_group()
    want = steps(env.device, shard=False)
    # NF4 made on the CPU (sharded path) and on the GPU may round a tie differently: 1% on the losses.
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    if not all(math.isfinite(v) for v in got) or worst > 1e-2:
        raise Failed(f"sharded losses {got}, unsharded {want}")
    detail = f"one rank: losses {got[0]:.3f} -> {got[-1]:.3f}, unsharded {want[0]:.3f} -> {want[-1]:.3f}"
    if torch.cuda.device_count() < 2:
        return detail + "; one GPU: the 2-process CLI run needs two"
    from peft import PeftModel

    cwd = env.work / "lora-qlora-fsdp"
    p = dtrain(env, "train", "lora", "--model", "tiny-llama", "--data", str(env.text()), "--max-steps",
               str(LORA_STEPS), "--seq-len", str(LORA_SEQ), "--batch-size", str(LORA_BATCH), "--lr", "2e-3",
               "--quant", "4bit", "--sharding", "fsdp", "--nproc", "2", cwd=cwd)  # fmt: skip
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {last_line(p)}")
    if "FSDP2 sharded" not in p.stdout or "QLoRA (NF4 base)" not in p.stdout:
        raise Failed("the run did not say it sharded a 4-bit base")
    run, rows = run_rows(cwd)
    ppl = [r["eval_perplexity"] for r in rows if "eval_perplexity" in r]
    if not ppl[-1] < ppl[0]:
        raise Failed(f"eval perplexity {ppl}")
    base, _ = load_base("tiny-llama", torch.float32, seed=0)
    n = sum(1 for name, _ in PeftModel.from_pretrained(base, str(run / "final" / "adapter")).named_parameters()
            if "lora_" in name)  # fmt: skip
    if n != 56:
        raise Failed(f"{n} LoRA tensors loaded")
    return detail + f"; 2 GPUs: eval perplexity {ppl[0]:.1f} -> {ppl[-1]:.1f}, adapter loads with stock peft"


CHECKS: dict[str, Callable[[Env], str]] = {
    **{f"mnist-{p}": (lambda env, p=p: check_mnist(env, p)) for p in ("fp32", "bf16", "fp16")},
    **{f"lora-{p}": (lambda env, p=p: check_lora(env, p)) for p in ("fp32", "bf16", "fp16")},
    "allreduce": check_allreduce,
    "lora-benchmark": check_lora_benchmark,
    "mnist-fp16-step-syncs": check_mnist_step_syncs,
    "mnist-cudnn-benchmark": check_mnist_cudnn_benchmark,
    "sdpa-gqa": check_sdpa_gqa,
    "tf32": check_tf32,
    "fused-linear": check_fused_linear,
    "lora-eval-syncs": check_lora_eval_syncs,
    "resume-bf16-to-fp16": check_resume_precision,
    "load-to-device": check_load_to_device,
    "fork-rng": check_fork_rng,
    "activation-checkpointing": check_activation_checkpointing,
    "qlora": check_qlora,
    "lora-qlora-run": check_lora_qlora_run,
    "lora-fsdp": check_lora_fsdp,
    "qlora-fsdp": check_qlora_fsdp,
}


def run_checks(names: list[str], cpu: bool) -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        env = Env(cpu, Path(tmp))
        where = torch.cuda.get_device_name(env.device) if env.cuda else "CPU"
        print(f"gpu_smoke on {where}, torch {torch.__version__}, precisions {', '.join(env.precisions)}", flush=True)
        for name in names:
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):  # library chatter off the result lines
                    detail = CHECKS[name](env)
                status = "PASS"
            except Skip as e:
                status, detail = "SKIP", str(e)
            except Failed as e:
                status, detail = "FAIL", str(e)
            except Exception as e:  # noqa: BLE001 - a crashed check is a failed one, with its reason
                status, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
            failed += status == "FAIL"
            print(f"{status} {name}: {detail} [{time.perf_counter() - t0:.0f} s]", flush=True)
    return 1 if failed else 0


def parse_only(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(CHECKS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where there is a GPU")
    p.add_argument("--only", type=parse_only, default=list(CHECKS), help="comma-separated checks (default: all)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    os.environ.setdefault("DTRAIN_OFFLINE", "1")
    sys.exit(run_checks(args.only, args.cpu))


if __name__ == "__main__":
    main()
