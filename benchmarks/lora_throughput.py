"""LoRA training tokens/s: dtrain against transformers' Trainer on padded lines and on packed blocks.

    python benchmarks/lora_throughput.py --json out.json    # all three, default settings: minutes on 2 cores
    python benchmarks/lora_throughput.py --quick              # smoke run, one to two minutes
    python benchmarks/lora_throughput.py --only ours,trainer-packed --rounds 5   # the CPU ratio, interleaved

Three pipelines train the same LoRA adapter (r 8, alpha 16, attention and MLP projections) on the same
preset model, corpus, sequence length, batch, learning rate, precision and number of optimizer steps,
one after the other, each in a process of its own:

- ours: `dtrain train lora` as a user runs it (packed blocks, no padding);
- trainer-padded: `transformers.Trainer` on one example per line, each padded to --seq-len (what the
  issue measured: ~18% real tokens), or with --padding longest to the longest line in its batch;
- trainer-packed: `Trainer` on the corpus joined with end-of-text and cut into full blocks (run_clm).

Only real (non-padding) tokens count. The first --warmup-steps optimizer steps are left out of the
clock. With --rounds N the pipelines run in turn N times, every other round in reverse order (ours,
Trainer, Trainer, ours, ...): a shared machine's speed drifts 10-40% from minute to minute, so one run
after the other can show any ratio; each round's ratio compares neighbours in time, and the median
round is reported.
benchmarks/README.md says what each figure measures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# Dense peak FLOP/s by GPU name and precision: one table for dtrain, with its datasheet sources.
from dtrain.common.accelerators import peak_flops
from dtrain.common.config import Precision
from dtrain.common.precision import resolve_precision
from dtrain.lora.data import read_texts
from dtrain.lora.model import PRESETS, apply_lora, load_base

PIPELINES = ("ours", "trainer-padded", "trainer-packed")
SETTINGS = ("steps", "warmup_steps", "seq_len", "batch_size", "lr", "precision", "padding", "nproc", "quick", "rounds")
# What all three train: dtrain's LoRA defaults, spelled out so both sides get the same numbers.
LORA_R = 8
LORA_ALPHA = 16.0
LORA_DROPOUT = 0.0
SEED = 0
TEXT_FIELD = "text"
QUICK_CORPUS_BYTES = 256 * 1024  # --quick: stdlib files up to this much text (~1,000 blocks of 256)
QUICK_STEPS, QUICK_WARMUP = 6, 2
# dtrain evaluates before step 1 and after the last step, outside the timed steps; a cap keeps that
# from dominating the wall time on a large corpus.
OURS_EVAL_BATCHES = 4
PIPELINE_STOP_GRACE_S = 60.0  # after Ctrl-C, how long a pipeline may take to stop before it is killed
# Settings a benchmark must not inherit from the caller's shell; where caches are may pass.
KEEP_ENV = {"DTRAIN_CACHE_DIR", "DTRAIN_OFFLINE"}
FLOPS_FORMULA = (
    "FLOPs per trained token = 4 N + 12 L T d: N the weights of every matrix product (output projection "
    "included, input embedding not), L layers, T the sequence length, d the attention width; "
    "benchmarks/README.md, 'MFU: the formula', says what each term counts and where it comes from"
)
MEASURES = {
    "tokens_per_s": "real (non-padding) tokens trained per second, over optimizer steps warmup+1..steps: "
    "the tokens of those steps divided by the wall time from the end of step `warmup` to the end of the "
    "last step (data loading, logging and every per-step overhead included; GPU work synchronised at both "
    "ends). ours: the `time` stamps of dtrain's metrics.jsonl rows at those two steps",
    "real_fraction": "real tokens / token slots the model computed (padding included)",
    "peak_rss_mib": "peak resident memory of the largest single process of the pipeline (os.wait4's "
    "ru_maxrss: for ours the torchrun worker, not the sum over workers)",
    "peak_gpu_mib": "torch.cuda.max_memory_allocated in the training process; dtrain does not report it",
    "mfu": f"tokens_per_s x flops_per_token / peak_flops; {FLOPS_FORMULA}",
    "load_average": "os.getloadavg() (1, 5, 15 min) when the pipeline started and when it ended",
}


@dataclasses.dataclass(kw_only=True)
class Result:
    name: str
    command: list[str]
    tokens_per_s: float
    real_fraction: float
    timed_steps: int
    timed_s: float
    real_tokens: int
    peak_rss_mib: float
    peak_gpu_mib: float | None
    mfu: float | None
    wall_s: float
    threads: int
    first_loss: float | None
    last_loss: float | None
    load_average: dict[str, list[float]]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Launched:
    wall_s: float
    peak_rss_mib: float
    load_average: dict[str, list[float]]


def launch(cmd: list[str], name: str, **kw: Any) -> Launched:
    """Run `cmd` to the end with its output on our stderr (stdout is for the table). Waits with
    os.wait4 for the child's resource usage: its ru_maxrss is the peak RSS of the largest process
    in its tree (itself or a descendant it waited for)."""
    print(f"[{name}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr, **kw)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C reached the child too: let it stop its own children first
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=PIPELINE_STOP_GRACE_S)
        proc.kill()
        proc.wait()
        raise
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if code != 0:
        sys.exit(f"error: the {name} run failed (exit {code}); its output is above")
    return Launched(
        wall_s=wall,
        peak_rss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
        load_average={"start": load_start, "end": list(os.getloadavg())},
    )


def threads_for(nproc: int) -> int:
    """Cores per process, as dtrain's launcher shares them out."""
    return max(1, (os.cpu_count() or 1) // nproc)


def write_corpus(path: Path, limit_bytes: int | None) -> Path:
    """The default corpus: the standard library's top-level .py files, sorted, one JSONL record per
    file (so every pipeline sees the same documents, each ended by end-of-text)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    size = 0
    with path.open("w") as f:
        for p in files:
            text = p.read_bytes().decode("utf-8", errors="replace")
            f.write(json.dumps({TEXT_FIELD: text}) + "\n")
            size += len(text)
            if limit_bytes and size >= limit_bytes:
                break
    return path


def gpu_info() -> tuple[str, float]:
    """The GPU's name and compute capability from nvidia-smi: asking torch would open a CUDA context in
    this process, which holds GPU memory while the pipelines run."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        name, cap = (f.strip() for f in out.strip().rsplit(",", 1))
        return name or "cuda", float(cap)
    except (OSError, subprocess.SubprocessError, ValueError):
        return "cuda", 0.0


def default_precision(gpu: tuple[str, float] | None) -> str:
    """bf16 on a GPU that has it (compute capability 8.0 and later), fp16 on one that does not (a T4),
    fp32 on the CPU: what `dtrain train --precision auto` picks."""
    if gpu is None:
        return "fp32"
    return "bf16" if gpu[1] >= 8.0 else "fp16"


def flops_per_token(model_name: str, seq_len: int) -> tuple[float, dict[str, int]]:
    """FLOPS_FORMULA for a preset at `seq_len`, from a meta-device copy of the model."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's projections

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = load_base(model_name, torch.float32, seed=SEED)
    products = (torch.nn.Linear, Conv1D)
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, products)}  # tied once
    n = sum(weights.values())
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    width = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    attention = 12 * layers * seq_len * width
    figures = {"total": sum(p.numel() for p in model.parameters()), "matmul_weights": n, "layers": layers,
               "attention_width": width, "attention_flops_per_token": attention}  # fmt: skip
    return 4.0 * n + attention, figures


# ---------------------------------------------------------------------------------------------
# ours: the dtrain CLI


def run_ours(args: argparse.Namespace, corpus: str, work: Path) -> Result:
    # The console script next to this interpreter, so the benchmark and dtrain share one install.
    exe = Path(sys.executable).with_name("dtrain")
    cmd = [str(exe), "train", "lora", "--model", args.model, "--data", corpus,
           "--max-steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--lora-r", str(LORA_R), "--lora-alpha", str(LORA_ALPHA),
           "--lora-dropout", str(LORA_DROPOUT), "--seed", str(SEED), "--nproc", str(args.nproc),
           "--precision", args.precision, "--output", str(work / "runs")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_") or k in KEEP_ENV}
    # A metrics row at the end of the warm-up and every warmup steps after it; the evaluations
    # around the run are capped (they are outside the clock either way).
    env.update(DTRAIN_LOG_EVERY=str(args.warmup_steps), DTRAIN_LORA_EVAL_BATCHES=str(OURS_EVAL_BATCHES))
    # cwd: a dtrain.toml where the benchmark is started must not change the config.
    ran = launch(cmd, "ours", cwd=work, env=env)

    (run,) = (work / "runs").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "tokens_per_s" in r]
    by_step = {r["step"]: r for r in train_rows}
    start, end = by_step[args.warmup_steps], by_step[args.steps]
    timed_steps = args.steps - args.warmup_steps
    tokens = timed_steps * args.batch_size * args.seq_len  # packed blocks: every token is real
    timed_s = end["time"] - start["time"]
    # dtrain's own figure, for comparison: its windows leave out the time between steps spent on
    # the preemption check and the checkpointer (on a GPU, that includes waiting for the step).
    windows, prev = [], 0
    for r in train_rows:
        n = (r["step"] - prev) * args.batch_size * args.seq_len
        if prev >= args.warmup_steps:
            windows.append((n, n / r["tokens_per_s"]))
        prev = r["step"]
    reported = sum(w[0] for w in windows) / sum(w[1] for w in windows)
    return Result(
        name="ours",
        command=cmd,
        tokens_per_s=tokens / timed_s,
        real_fraction=1.0,
        timed_steps=timed_steps,
        timed_s=timed_s,
        real_tokens=tokens,
        peak_rss_mib=ran.peak_rss_mib,
        peak_gpu_mib=None,
        mfu=None,
        wall_s=ran.wall_s,
        threads=threads_for(args.nproc),
        first_loss=train_rows[0]["loss"],
        last_loss=train_rows[-1]["loss"],
        load_average=ran.load_average,
        extra={"dtrain_reported_tokens_per_s": reported, "run_dir": run.name},
    )


# ---------------------------------------------------------------------------------------------
# the baselines: transformers' Trainer with a peft model (this file re-invoked with --worker)


def run_baseline(kind: str, args: argparse.Namespace, corpus: str, work: Path) -> Result:
    out = work / "result.json"
    threads = threads_for(1)
    cmd = [sys.executable, __file__, "--worker", kind.removeprefix("trainer-"), "--result", str(out),
           "--model", args.model, "--data", corpus, "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--precision", args.precision,
           "--threads", str(threads), "--padding", args.padding]  # fmt: skip
    ran = launch(cmd, kind, cwd=work, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    r = json.loads(out.read_text())
    return Result(
        name=kind,
        command=cmd,
        tokens_per_s=r["real_tokens"] / r["timed_s"],
        real_fraction=r["real_tokens"] / r["slot_tokens"],
        timed_steps=r["timed_steps"],
        timed_s=r["timed_s"],
        real_tokens=r["real_tokens"],
        peak_rss_mib=ran.peak_rss_mib,
        peak_gpu_mib=r["peak_gpu_mib"],
        mfu=None,
        wall_s=ran.wall_s,
        threads=r["threads"],
        first_loss=r["first_loss"],
        last_loss=r["last_loss"],
        load_average=ran.load_average,
        extra={"trainable_params": r["trainable_params"], "examples": r["examples"]},
    )


class Lines(torch.utils.data.Dataset):
    """The naive way: one example per non-empty line, ended by end-of-text, cut at seq_len."""

    def __init__(self, docs: list[str], tokenizer: Any, seq_len: int) -> None:
        eos = tokenizer.eos_token_id
        lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
        self.ids = [[*ids, eos][:seq_len] for ids in tokenizer.encode_many(lines)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> list[int]:
        return self.ids[i]


def pad_collate(pad_id: int, length: int | None):
    """Pad on the right to `length`, or (None) to the longest in the batch; attention mask 0 and label
    -100 on the padding: what DataCollatorForLanguageModeling(mlm=False) does after a tokenizer's
    padding="max_length" or padding=True, for a tokenizer that is not a HF one."""

    def collate(batch: list[list[int]]) -> dict[str, torch.Tensor]:
        longest = length or max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}

    return collate


class Blocks(torch.utils.data.Dataset):
    """The strong way, as run_clm's group_texts: every document's tokens and end-of-text joined,
    cut into full blocks of seq_len (the remainder dropped), labels = input_ids."""

    def __init__(self, docs: list[str], tokenizer: Any, seq_len: int) -> None:
        eos = tokenizer.eos_token_id
        stream = [tok for ids in tokenizer.encode_many(docs) for tok in (*ids, eos)]
        n = len(stream) // seq_len
        self.blocks = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def baseline_worker(args: argparse.Namespace) -> None:
    """One baseline run: the Trainer as its documentation shows it, plus a clock and a token count."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    bf16, fp16 = args.precision == "bf16", args.precision == "fp16"
    if cuda:  # the same process-wide math as dtrain's: fp32 products in TF32
        resolve_precision(Precision(args.precision), torch.device("cuda", 0)).configure()
    # As dtrain does: frozen base weights in the compute dtype only on a GPU; peft keeps LoRA's in fp32.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision) if cuda else None
    model, tokenizer = load_base(args.model, dtype or torch.float32, seed=SEED)
    model, _ = apply_lora(model, args.model, r=LORA_R, alpha=LORA_ALPHA, dropout=LORA_DROPOUT, targets=[], seed=SEED)
    docs = [t for t in read_texts(args.data, TEXT_FIELD) if t]
    if args.worker == "padded":
        length = args.seq_len if args.padding == "max-length" else None
        dataset, collate = Lines(docs, tokenizer, args.seq_len), pad_collate(tokenizer.pad_token_id, length)
    else:
        dataset, collate = Blocks(docs, tokenizer, args.seq_len), None  # None: default_data_collator

    sync = torch.cuda.synchronize if cuda else lambda: None
    clock: dict[int, float] = {}

    class Clock(TrainerCallback):
        """Wall time at the end of the warm-up and of the last step, GPU work finished."""

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step in (args.warmup_steps, args.steps):
                sync()
                clock[state.global_step] = time.perf_counter()

    class CountingTrainer(Trainer):
        """Counts the tokens of the timed steps as they reach the model (on the device, no sync)."""

        real: Any = 0
        slots = 0

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            if self.state.global_step >= args.warmup_steps:  # steps completed so far
                ids, mask = inputs["input_ids"], inputs.get("attention_mask")
                self.real = self.real + (mask.sum() if mask is not None else ids.numel())
                self.slots += ids.numel()
            return super().training_step(model, inputs, num_items_in_batch)

    targs = TrainingArguments(
        output_dir=str(Path(args.result).parent / "trainer"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        logging_steps=args.warmup_steps,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        use_cpu=not cuda,
        bf16=bf16,
        fp16=fp16,
        seed=SEED,
        label_names=["labels"],
        disable_tqdm=True,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = CountingTrainer(
        model=model, args=targs, train_dataset=dataset, data_collator=collate, callbacks=[Clock()]
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(args.result).write_text(
        json.dumps(
            {
                "timed_steps": args.steps - args.warmup_steps,
                "timed_s": clock[args.steps] - clock[args.warmup_steps],
                "real_tokens": int(trainer.real),
                "slot_tokens": trainer.slots,
                "threads": torch.get_num_threads(),
                "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "examples": len(dataset),
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
            }
        )
    )


# ---------------------------------------------------------------------------------------------
# report


def ratios(results: list[Result]) -> dict[str, float | None]:
    by = {r.name: r.tokens_per_s for r in results}

    def ratio(a: str, b: str) -> float | None:
        return by[a] / by[b] if a in by and b in by else None

    return {
        "ours_over_packed": ratio("ours", "trainer-packed"),
        "packed_over_padded": ratio("trainer-packed", "trainer-padded"),
        "ours_over_padded": ratio("ours", "trainer-padded"),
    }


def summarise(
    rounds: list[list[Result]],
) -> tuple[list[Result], dict[str, float | None], list[dict[str, float | None]]]:
    """Per pipeline, the result of its median round by tokens/s (the lower median for an even count);
    each ratio as the median of the per-round ratios; and the per-round ratios themselves."""
    per_round = [ratios(r) for r in rounds]
    names = sorted({r.name for r in rounds[0]}, key=PIPELINES.index)
    chosen = []
    for name in names:
        runs = sorted((r for rnd in rounds for r in rnd if r.name == name), key=lambda r: r.tokens_per_s)
        pick = runs[(len(runs) - 1) // 2]
        pick.extra["tokens_per_s_by_round"] = [r.tokens_per_s for rnd in rounds for r in rnd if r.name == name]
        chosen.append(pick)
    medians: dict[str, float | None] = {}
    for key in per_round[0]:
        values = [v for pr in per_round if (v := pr[key]) is not None]
        medians[key] = statistics.median(values) if values else None
    return chosen, medians, per_round


def report(
    results: list[Result],
    args: argparse.Namespace,
    device: str,
    flops: float,
    medians: dict[str, float | None],
    per_round: list[dict[str, float | None]],
) -> None:
    from rich.console import Console
    from rich.table import Table

    gpu = device != "cpu"
    rounds = f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    table = Table(
        title=f"LoRA on {args.model}: seq {args.seq_len}, batch {args.batch_size}, {args.precision}, {device}{rounds}",
        caption=f"tokens/s: real tokens of steps {args.warmup_steps + 1}-{args.steps} per second of wall time; "
        f"processes x threads: ours {args.nproc} x {threads_for(args.nproc)}, Trainer 1 x {threads_for(1)}",
    )
    cols = ["pipeline", "tokens/s", "real tokens", "peak RSS MiB", *(["peak GPU MiB", "MFU"] if gpu else [])]
    for col in [*cols, "wall s"]:
        table.add_column(col, justify="left" if col == "pipeline" else "right", no_wrap=col == "pipeline")
    for r in results:
        gpu_cols = [
            f"{r.peak_gpu_mib:,.0f}" if r.peak_gpu_mib is not None else "n/a",
            f"{r.mfu:.1%}" if r.mfu is not None else "n/a",
        ]
        table.add_row(
            r.name,
            f"{r.tokens_per_s:,.0f}",
            f"{r.real_fraction:.0%}",
            f"{r.peak_rss_mib:,.0f}",
            *(gpu_cols if gpu else []),
            f"{r.wall_s:.0f}",
        )
    console = Console()
    console.print(table)
    if gpu:
        peak = (
            f"{args.peak_flops / 1e12:g} TFLOP/s peak ({device}, {args.precision})"
            if args.peak_flops
            else (f"no peak known for {device} in {args.precision}: pass --peak-flops")
        )
        console.print(
            f"MFU = tokens/s x {flops / 1e9:.3f} GFLOP/token / {peak}; "
            f"{FLOPS_FORMULA}. Peak GPU memory of ours: n/a (dtrain does not report it).",
            highlight=False,
        )
    for key, label in (
        ("ours_over_packed", "ours / trainer-packed"),
        ("packed_over_padded", "trainer-packed / trainer-padded"),
    ):
        if medians[key] is None:
            continue
        line = f"{label} = {medians[key]:.2f}x"
        if len(per_round) > 1:
            line += f" (median; by round: {', '.join(f'{pr[key]:.2f}' for pr in per_round)})"
        console.print(line, highlight=False)
    if len(per_round) > 1:
        for res in results:
            by_round = ", ".join(f"{t:,.0f}" for t in res.extra["tokens_per_s_by_round"])
            console.print(f"{res.name} tokens/s by round: {by_round}", highlight=False)
    for res in results:
        if "dtrain_reported_tokens_per_s" in res.extra:
            console.print(
                f"(dtrain's own tokens_per_s over the same steps: {res.extra['dtrain_reported_tokens_per_s']:,.0f})",
                highlight=False,
            )
    loads = ", ".join(f"{r.name} {r.load_average['start'][0]:.2f}->{r.load_average['end'][0]:.2f}" for r in results)
    console.print(f"1-min load average at start->end: {loads} ({os.cpu_count()} CPUs)", highlight=False)


def parse_only(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PIPELINES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(PIPELINES)}, comma-separated")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(PRESETS), default="tiny-llama", help="dtrain preset (tiny-llama)")
    p.add_argument("--data", default="", help="text/JSONL file or directory (default: the stdlib's .py files)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per pipeline (40)")
    p.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the clock (5)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block; longest line (256)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step (8)")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (2e-4)")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="for all three (default: bf16 on a GPU that has it, fp16 on one that does not, fp32 on the CPU)",
    )
    p.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="--precision bf16")
    p.add_argument(
        "--padding",
        choices=["longest", "max-length"],
        default="max-length",
        help="trainer-padded pads every line to --seq-len (default: the issue's baseline, ~16-18%% real "
        "tokens) or each batch to its longest line",
    )
    p.add_argument("--nproc", type=int, default=1, help="dtrain processes (1); the baselines always run 1")
    p.add_argument("--only", type=parse_only, default=list(PIPELINES), help="comma-separated pipelines to run")
    p.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="GPU peak FLOP/s for MFU (default: from the GPU's name and the precision)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: a 256 KB corpus, 6 steps, 2 of warm-up")
    p.add_argument("--rounds", type=int, default=1, help="run the pipelines in turn this many times (1)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    # Internal: a baseline re-invokes this file.
    p.add_argument("--worker", choices=["padded", "packed"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup_steps = QUICK_STEPS, QUICK_WARMUP
    for name in ("steps", "warmup_steps", "seq_len", "batch_size", "nproc", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps >= args.steps:
        p.error("--warmup-steps must be below --steps: the steps after it are the ones timed")
    if args.batch_size % args.nproc:
        p.error("--batch-size must be divisible by --nproc")

    if args.worker:
        baseline_worker(args)
        return
    gpu = gpu_info() if torch.cuda.is_available() else None
    device = gpu[0] if gpu else "cpu"
    args.precision = args.precision or default_precision(gpu)
    if gpu and not args.peak_flops:
        args.peak_flops = peak_flops(device, args.precision)
    flops, params = flops_per_token(args.model, args.seq_len)
    rounds: list[list[Result]] = []
    with tempfile.TemporaryDirectory(prefix="lora-throughput-") as tmp:
        corpus = args.data or str(write_corpus(Path(tmp) / "corpus.jsonl", QUICK_CORPUS_BYTES if args.quick else None))
        for i in range(args.rounds):
            results = []
            # Every other round in reverse (A B, B A, ...): a steady drift across a round favours neither.
            for name in PIPELINES if i % 2 == 0 else PIPELINES[::-1]:
                if name in args.only:
                    work = Path(tmp) / f"{name}-{i + 1}"
                    work.mkdir()
                    ran = run_ours(args, corpus, work) if name == "ours" else run_baseline(name, args, corpus, work)
                    if device != "cpu" and args.peak_flops:
                        ran.mfu = ran.tokens_per_s * flops / args.peak_flops
                    results.append(ran)
            rounds.append(results)
    results, medians, per_round = summarise(rounds)
    report(results, args, device, flops, medians, per_round)
    if args.json:
        figures = {
            "model": args.model,
            "parameters": params,
            "data": args.data or "stdlib top-level .py files" + (" (quick slice)" if args.quick else ""),
            "settings": {k: getattr(args, k) for k in SETTINGS},
            "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": LORA_DROPOUT, "targets": "preset default"},
            "device": device,
            "cpus": os.cpu_count(),
            "flops_per_token": flops,
            "flops_formula": FLOPS_FORMULA,
            "peak_flops": args.peak_flops if device != "cpu" else None,
            "measures": MEASURES,
            "pipelines": {r.name: dataclasses.asdict(r) for r in results},
            "ratios": medians,
            "ratios_by_round": per_round,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
