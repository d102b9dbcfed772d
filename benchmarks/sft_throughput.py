"""SFT training tokens/s and peak memory on the CPU: dtrain with masking and packing on versus off,
and TRL's SFTTrainer on the same data, model and settings.

    python benchmarks/sft_throughput.py                 # default settings: a few minutes on 2 cores
    python benchmarks/sft_throughput.py --quick         # smoke run
    python benchmarks/sft_throughput.py --json out.json --rounds 3

The model is tiny-llama's shape (4 layers, hidden 256, 4 heads, MLP 688, random weights) with a
byte-level BPE tokenizer trained here on the data's words (~2,000 tokens) and a chat template with
`{% generation %}` markers (so TRL's assistant_only_loss works; dtrain finds the assistant turns by
incremental rendering, and renders the same text). The data is chat conversations of 1-4 turns with
lengths drawn from a long-tailed distribution, like real SFT sets. Every pipeline trains the same
LoRA (r 8, alpha 16, the seven Llama projections) with the same batch (8 rows of up to --seq-len),
learning rate, fp32 and number of steps, each in a process of its own:

- dtrain-packed-masked: `python -m dtrain.lora.train` as a run does it (defaults: packing on, loss on
  assistant tokens only);
- dtrain-unpacked-all: --no-packing --train-on-all: one conversation a row, padded to the longest in
  its micro-batch, loss on every token;
- trl-packed-masked: SFTTrainer, packing=True (best-fit decreasing, padding-free with restarting
  position ids), assistant_only_loss=True;
- trl-unpacked-all: SFTTrainer, packing=False (padded to the longest in the batch).

Only real (non-padding) tokens count; the first --warmup-steps steps are left out of the clock.
Peak memory is the process's peak resident set (os.wait4's ru_maxrss). TRL is installed into the
venv for this benchmark only (pip install trl); it is not a dtrain dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PIPELINES = ("dtrain-packed-masked", "dtrain-unpacked-all", "trl-packed-masked", "trl-unpacked-all")
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
LR, BATCH, SEED = 2e-4, 8, 0


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


def run_dtrain(kind: str, args: argparse.Namespace, model_dir: Path, data: Path, work: Path, env: dict) -> dict:
    out = work / f"runs-{kind}-{time.time_ns()}"
    steps = 2 * args.warmup_steps if args.steps <= args.warmup_steps else args.steps
    extra = ["--no-packing", "--train-on-all"] if kind == "dtrain-unpacked-all" else []
    cmd = [sys.executable, "-m", "dtrain.lora.train", "--model", str(model_dir), "--data", str(data),
           "--seq-len", str(args.seq_len), "--batch-size", str(BATCH), "--lr", str(LR), "--lora-r", "8",
           "--lora-alpha", "16", "--max-steps", str(steps), "--log-every", "1", "--eval-batches", "1",
           "--checkpoint-every", "0", "--precision", "fp32", "--output", str(out), *extra]  # fmt: skip
    rss, _ = launch(cmd, env)
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] > args.warmup_steps]
    # log every step: each row's tokens/s covers its own step; the clock's total is the sum of times.
    tokens = sum(r["tokens_per_s"] * r["_dt"] for r in _with_dt(rows) if r in timed)
    seconds = sum(r["_dt"] for r in _with_dt(rows) if r in timed)
    return {"tokens_per_s": tokens / seconds, "peak_rss_mib": rss, "steps_timed": len(timed)}


def _with_dt(rows: list[dict]) -> list[dict]:
    """Training rows with the wall time of their step, from tokens and tokens/s (the run logs both
    per step with --log-every 1; samples_per_s gives rows, so seconds = batch / samples_per_s)."""
    out = []
    for r in rows:
        if "samples_per_s" in r:
            r["_dt"] = BATCH / r["samples_per_s"]
            out.append(r)
    return out


def run_trl(kind: str, args: argparse.Namespace, model_dir: Path, data: Path, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--trl-worker", kind, "--model-dir", str(model_dir), "--data", str(data),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps)]  # fmt: skip
    rss, text = launch(cmd, env)
    result = json.loads(text.strip().splitlines()[-1])
    return {**result, "peak_rss_mib": rss}


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL run as its documentation shows it (SFTConfig + peft LoraConfig), with a clock that
    counts the real tokens of each step after warmup."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(SEED)
    packed = args.trl_worker == "trl-packed-masked"
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa", dtype=torch.float32)
    ds = datasets.load_dataset("json", data_files=args.data, split="train")
    cfg = SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=BATCH,
        learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0, max_length=args.seq_len, packing=packed,
        assistant_only_loss=packed, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, seed=SEED, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    clock = {"tokens": 0, "start": None, "end": None, "step": 0}

    class Trainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            clock["step"] += 1
            if clock["step"] == args.warmup_steps + 1:
                clock["start"] = time.perf_counter()
            if clock["step"] > args.warmup_steps:
                mask = inputs.get("attention_mask")
                clock["tokens"] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class End(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock["end"] = time.perf_counter()

    trainer = Trainer(
        model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora, callbacks=[End()]
    )
    trainer.train()
    timed = clock["step"] - args.warmup_steps
    print(json.dumps({"tokens_per_s": clock["tokens"] / (clock["end"] - clock["start"]), "steps_timed": timed}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default=",".join(PIPELINES))
    p.add_argument("--quick", action="store_true", help="6 steps, 2 of warmup, 400 conversations")
    p.add_argument("--json", default="")
    p.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if args.quick:
        args.steps, args.warmup_steps, args.conversations = 6, 2, 400
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DTRAIN_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in args.only.split(",")}
    with tempfile.TemporaryDirectory(prefix="sft-bench-") as tmp:
        work = Path(tmp)
        model_dir, data = make_setup(work, args.conversations)
        for r in range(args.rounds):
            order = list(results) if r % 2 == 0 else list(reversed(results))  # neighbours in time
            for kind in order:
                if kind.startswith("dtrain"):
                    res = run_dtrain(kind, args, model_dir, data, work, env)
                else:
                    res = run_trl(kind, args, model_dir, data, env)
                results[kind].append(res)
                tps, rss = res["tokens_per_s"], res["peak_rss_mib"]
                print(f"round {r + 1} {kind}: {tps:,.0f} tokens/s, peak RSS {rss:,.0f} MiB", flush=True)
    summary = {}
    print(f"\nmedian of {args.rounds} round(s); seq_len {args.seq_len}, batch {BATCH}, {args.steps} steps "
          f"({args.warmup_steps} warmup), {args.threads} threads, fp32, CPU")  # fmt: skip
    print(f"{'pipeline':<24} {'tokens/s':>10} {'peak RSS MiB':>13}")
    for kind, rs in results.items():
        tps = sorted(x["tokens_per_s"] for x in rs)[len(rs) // 2]
        rss = sorted(x["peak_rss_mib"] for x in rs)[len(rs) // 2]
        summary[kind] = {"tokens_per_s": tps, "peak_rss_mib": rss, "rounds": rs}
        print(f"{kind:<24} {tps:>10,.0f} {rss:>13,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": summary}, indent=1))


if __name__ == "__main__":
    main()
