"""A fair race on the CPU: dtrain's LoRA SFT against TRL's SFTTrainer, the same work on both sides.

    python benchmarks/sft_throughput.py                         # 2 rounds, 16 steps: ~15 min on 2 cores
    python benchmarks/sft_throughput.py --rounds 3 --steps 40   # the issue's length
    python benchmarks/sft_throughput.py --quick                 # smoke run

Both sides get, every setting printed at the start:
- the same model: a Llama built from a config (4 layers, hidden 256, 4 heads, MLP 688, random weights
  from one seed) and a byte-level BPE tokenizer trained here on the data's words (~2,000 tokens), with a
  chat template carrying `{% generation %}` markers so TRL's assistant_only_loss works;
- the same data: --conversations chat records made from one seed (1-4 turns, long-tailed lengths), loss
  on the assistant turns only; the script checks that dtrain's trained tokens and TRL's assistant mask
  are the same tokens on the first --mask-check records before anything runs;
- the same rows: padding-free packing by best-fit decreasing into rows of --seq-len tokens with
  restarting position ids (a per-document causal mask), ONE row per forward (micro-batch 1) and
  8 forwards accumulated per optimizer step, so the attention work is the same on both sides;
- fp32, LoRA r 8 / alpha 16 on the seven projections, AdamW, lr 2e-4, cosine, clipping at 1.0;
- row A: activation (gradient) checkpointing off on both; row B: on for both (non-reentrant);
- dtrain with its fused CPU kernels (dtrain.lora.fused) and without them, as separate pipelines.

Rounds run in turn, every pipeline once per round, the order reversed every other round, so
neighbours in time share the machine's load; the summary is the median per pipeline and the
dtrain/TRL ratio within each round. Only real (non-padding) tokens count, the first --warmup-steps
steps are left out of the clock, and peak memory is each process's peak resident set, read the same
way for both (os.wait4's ru_maxrss of the child). TRL's version is pinned (PINNED_TRL, dtrain's dev
extra); the script refuses to race another.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PINNED = {"trl": "1.16.0"}  # what the race was run against; pyproject's dev extra pins the same
ROWS = {"A": "off", "B": "on"}  # activation checkpointing, for both sides
PIPELINES = ("dtrain-fused", "dtrain-unfused", "trl")
WORDS = (  # noqa: SIM905 - a sentence is easier to read than a list of strings
    "the a an cat dog bird sat ran flew on under over mat log tree red blue green big small old new why how "
    "what when where is are was were can could will would should please tell me about explain list give "
    "one two three four five first second then next finally because so and or but not very quite"
).split()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, ROWS_PER_STEP, SEED, MAX_GRAD_NORM = 2e-4, 8, 0, 1.0


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def make_setup(work: Path, conversations: int) -> tuple[Path, Path]:
    """A model directory (tokenizer + random tiny-llama-shaped weights) and chat data."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(SEED)
    rows = []
    for _ in range(conversations):
        msgs = []
        for _turn in range(rng.choice((1, 1, 2, 3, 4))):
            msgs.append({"role": "user", "content": sentence(rng, int(rng.lognormvariate(2.5, 0.8)))})
            msgs.append({"role": "assistant", "content": sentence(rng, int(rng.lognormvariate(3.5, 0.9)))})
        rows.append({"messages": msgs})
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    texts = [m["content"] for r in rows for m in r["messages"]]
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )  # fmt: skip
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tok.chat_template = TEMPLATE
    model_dir = work / "model"
    tok.save_pretrained(model_dir)
    torch.manual_seed(SEED)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **LLAMA)).save_pretrained(model_dir)
    return model_dir, data


def check_pins() -> None:
    for name, want in PINNED.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "not installed"
        if have != want:
            raise SystemExit(f"{name} {have}: this race is pinned to {name}=={want} (pip install '{name}=={want}')")


def check_masks(model_dir: Path, data: Path, n: int) -> int:
    """dtrain's trained tokens (labels != -100) equal TRL's assistant mask (the tokenizer's
    return_assistant_tokens_mask, what assistant_only_loss uses) on the first n records; returns how
    many tokens train in them."""
    from transformers import AutoTokenizer

    from dtrain.lora import sft
    from dtrain.lora.model import HFTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    recs = [json.loads(ln) for ln in data.read_text().splitlines()[:n]]
    rows = [(f"chat.jsonl:{i + 1}", r) for i, r in enumerate(recs)]
    cfg = argparse.Namespace(format=sft.DataFormat.AUTO, messages_field="messages", prompt_field="",
                             input_field="", completion_field="", text_field="text")  # fmt: skip
    enc = sft.encode(HFTokenizer(tok), rows, sft.resolve_fields(rows, cfg), False, 10**6)
    trained = 0
    for (where, rec), ex in zip(rows, enc.examples, strict=True):
        out = tok.apply_chat_template(
            rec["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        theirs = [bool(m) for m in out["assistant_masks"]]
        ours = [lab != sft.IGNORE for lab in ex.labels]
        if out["input_ids"] != ex.ids or ours != theirs:
            raise SystemExit(f"{where}: dtrain and TRL would train different tokens; the race would not be fair")
        trained += sum(ours)
    return trained


def launch(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run `cmd`; its output and peak RSS (MiB) from os.wait4 (the child's own ru_maxrss)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{text[-3000:]}")
    return usage.ru_maxrss / 1024, text


def dtrain_args(args: argparse.Namespace, model_dir: Path, data: Path, out: Path, ckpt: str) -> list[str]:
    return ["--model", str(model_dir), "--data", str(data), "--seq-len", str(args.seq_len),
            "--batch-size", str(ROWS_PER_STEP), "--grad-accum", str(ROWS_PER_STEP), "--lr", str(LR),
            "--lora-r", "8", "--lora-alpha", "16", "--max-grad-norm", str(MAX_GRAD_NORM),
            "--max-steps", str(args.steps), "--log-every", "1", "--eval-batches", "1", "--checkpoint-every", "0",
            "--precision", "fp32", "--activation-checkpointing", ckpt, "--packing", "--output", str(out)]  # fmt: skip


def run_dtrain(
    kind: str, ckpt: str, args: argparse.Namespace, model_dir: Path, data: Path, work: Path, env: dict
) -> dict:
    """dtrain's own training entry point (dtrain.lora.train.main, what `dtrain train lora` runs), in a
    worker of this script so that its fused kernels can be left out for the unfused pipeline."""
    out = work / f"runs-{kind}-{time.time_ns()}"
    cmd = [sys.executable, __file__, "--dtrain-worker", kind, "--", *dtrain_args(args, model_dir, data, out, ckpt)]
    rss, text = launch(cmd, env)
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] > args.warmup_steps]
    # Logged every step: each row's tokens/s and samples/s cover its own step (rows = samples).
    seconds = sum(ROWS_PER_STEP / r["samples_per_s"] for r in timed)
    tokens = sum(r["tokens_per_s"] * ROWS_PER_STEP / r["samples_per_s"] for r in timed)
    fill = next((ln for ln in text.splitlines() if "of row slots hold tokens" in ln), "")
    fill_pct = float(fill.split("(")[-1].split("%")[0]) if fill else float("nan")
    fused = "fused: 0 lora linears" not in text
    if fused != (kind == "dtrain-fused"):
        raise SystemExit(f"{kind}: the run's log says fused kernels were {'on' if fused else 'off'}")
    return {"tokens_per_s": tokens / seconds, "peak_rss_mib": rss, "steps_timed": len(timed), "fill_pct": fill_pct,
            "final_loss": rows[-1].get("loss") or next(r["loss"] for r in reversed(rows) if "loss" in r)}  # fmt: skip


def dtrain_worker(kind: str, argv: list[str]) -> None:
    from dtrain.lora import train

    if kind == "dtrain-unfused":
        train.fuse_model = lambda model: {"lora_linears": 0, "rms_norms": 0, "attention": 0}
    train.main(argv)


def run_trl(ckpt: str, args: argparse.Namespace, model_dir: Path, data: Path, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--trl-worker", ckpt, "--model-dir", str(model_dir), "--data", str(data),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps)]  # fmt: skip
    rss, text = launch(cmd, env)
    result = json.loads(text.strip().splitlines()[-1])
    return {**result, "peak_rss_mib": rss}


def trl_settings(args: argparse.Namespace, ckpt: str) -> dict[str, Any]:
    return dict(
        max_steps=args.steps, per_device_train_batch_size=1, gradient_accumulation_steps=ROWS_PER_STEP,
        learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM,
        max_length=args.seq_len, packing=True, packing_strategy="bfd", padding_free=True, assistant_only_loss=True,
        gradient_checkpointing=ckpt == "on", gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False, seed=SEED,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL run as its documentation shows it (SFTConfig + peft LoraConfig), with a clock that
    counts the real tokens of each step after warmup."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa", dtype=torch.float32)
    ds = datasets.load_dataset("json", data_files=args.data, split="train")
    cfg = SFTConfig(output_dir=tempfile.mkdtemp(), **trl_settings(args, args.trl_worker))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    clock = {"tokens": 0, "start": None, "end": None, "forwards": 0, "losses": []}
    warm_forwards = args.warmup_steps * ROWS_PER_STEP

    class Trainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            clock["forwards"] += 1
            if clock["forwards"] == warm_forwards + 1:
                clock["start"] = time.perf_counter()
            if clock["forwards"] > warm_forwards:  # padding-free: every position of the row is a real token
                clock["tokens"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class End(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock["end"] = time.perf_counter()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                clock["losses"].append(logs["loss"])

    trainer = Trainer(
        model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora, callbacks=[End()]
    )
    lengths = [sum(x) for x in trainer.train_dataset["seq_lengths"]]
    trainer.train()
    print(json.dumps({"tokens_per_s": clock["tokens"] / (clock["end"] - clock["start"]),
                      "steps_timed": args.steps - args.warmup_steps,
                      "fill_pct": 100 * sum(lengths) / (len(lengths) * args.seq_len),
                      "final_loss": clock["losses"][-1]}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", default="A,B", help="A: checkpointing off on both sides, B: on for both")
    p.add_argument("--only", default=",".join(PIPELINES))
    p.add_argument("--mask-check", type=int, default=300, help="records whose trained tokens are compared")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 of warmup, 400 conversations")
    p.add_argument("--json", default="")
    p.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--dtrain-worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dtrain_worker:
        dtrain_worker(args.dtrain_worker, args.rest)
        return
    if args.trl_worker:
        trl_worker(args)
        return
    check_pins()
    if args.quick:
        args.steps, args.warmup_steps, args.conversations = 6, 2, 400
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DTRAIN_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cells = [(row, kind) for row in args.rows.split(",") for kind in args.only.split(",")]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory(prefix="sft-race-") as tmp:
        work = Path(tmp)
        model_dir, data = make_setup(work, args.conversations)
        trained = check_masks(model_dir, data, args.mask_check)
        versions = {n: importlib.metadata.version(n) for n in ("torch", "transformers", "peft", "trl")}
        print(f"versions: {versions}")
        print(f"data: {args.conversations} chat records (seed {SEED}); dtrain's and TRL's trained tokens are the same "
              f"on the first {args.mask_check} ({trained:,} tokens)")  # fmt: skip
        print("dtrain: " + " ".join(dtrain_args(args, Path("MODEL"), Path("DATA"), Path("OUT"), "off|on")))
        print(f"TRL SFTConfig: {trl_settings(args, 'off|on')} + peft LoraConfig(r=8, lora_alpha=16, lora_dropout=0, "
              f"target_modules={TARGETS}); model attn sdpa, fp32")  # fmt: skip
        print(f"rows: {ROWS}; {args.threads} threads a process, one process each, CPU", flush=True)
        for r in range(args.rounds):
            for row, kind in cells if r % 2 == 0 else list(reversed(cells)):  # neighbours in time
                ckpt = ROWS[row]
                if kind.startswith("dtrain"):
                    res = run_dtrain(kind, ckpt, args, model_dir, data, work, env)
                else:
                    res = run_trl(ckpt, args, model_dir, data, env)
                results[(row, kind)].append(res)
                print(f"round {r + 1} row {row} (checkpointing {ckpt}) {kind}: {res['tokens_per_s']:,.0f} tokens/s, "
                      f"peak RSS {res['peak_rss_mib']:,.0f} MiB, rows {res['fill_pct']:.1f}% full, "
                      f"final loss {res['final_loss']:.4f}", flush=True)  # fmt: skip
    print(f"\nmedian of {args.rounds} round(s); seq_len {args.seq_len}, {ROWS_PER_STEP} rows of 1 a step, "
          f"{args.steps} steps ({args.warmup_steps} warmup), {args.threads} threads, fp32, CPU")  # fmt: skip
    print(f"{'row':<5}{'pipeline':<16}{'tokens/s':>10}{'peak RSS MiB':>14}{'fill %':>8}{'x TRL tokens/s':>16}"
          f"{'x TRL memory':>14}")  # fmt: skip
    summary = []
    for (row, kind), rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "peak_rss_mib", "fill_pct")}
        trl = results.get((row, "trl"))
        ratio = mem = float("nan")
        if trl and kind != "trl":  # within each round, then the median of the rounds' ratios
            ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rs, trl, strict=True))
            mem = statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(rs, trl, strict=True))
        summary.append({"row": row, "checkpointing": ROWS[row], "pipeline": kind, **med, "x_trl_tokens_per_s": ratio,
                        "x_trl_memory": mem, "rounds": rs})  # fmt: skip
        print(f"{row:<5}{kind:<16}{med['tokens_per_s']:>10,.0f}{med['peak_rss_mib']:>14,.0f}{med['fill_pct']:>8.1f}"
              f"{ratio:>16.2f}{mem:>14.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": summary}, indent=1))


if __name__ == "__main__":
    main()
