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
- the same attention: transformers' sdpa on both (dtrain pinned with `--attention sdpa`, so whatever
  its `auto` picks does not change the race). Neither side passes an attention mask, so transformers
  builds a dense per-document causal mask from the restarting position ids (masking_utils'
  find_packed_sequence_indices) and SDPA attends over the whole L x L with it. Each worker watches
  its first SDPA calls (probe_attention) and the script refuses a run whose masks are not exactly
  per-document causal, or differ from the other side's;
- fp32, LoRA r 8 / alpha 16 / dropout 0 on the seven projections (the trainable counts are checked
  equal), AdamW, lr 2e-4, cosine, clipping at 1.0;
- row A: activation (gradient) checkpointing off on both; row B: on for both (non-reentrant), set
  explicitly on both sides and read back from the model as it trained;
- dtrain with its fused CPU kernels (dtrain.lora.fused) and without them, as separate pipelines.

Rounds run in turn, every pipeline once per round, the order reversed every other round, so
neighbours in time share the machine's load; the summary is the median per pipeline and the
dtrain/TRL ratio within each round. Only real (non-padding) tokens count, the first --warmup-steps
steps are left out of the clock, and peak memory is each process's peak resident set, read the same
way for both (os.wait4's ru_maxrss of the child). The load average is printed at the start, with
every run, and at the end: on a shared machine only the ratios within a round mean much. TRL's
version is pinned (PINNED, as dtrain's dev extra pins it); the script refuses to race another.
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
PROBE_CALLS = 32  # SDPA calls watched per run: the first step's forwards (4 layers x 8 rows in row A)
WORKER_LINE = "race-worker: "  # a dtrain worker's last line: what it trained with, as JSON


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
            "--precision", "fp32", "--activation-checkpointing", ckpt, "--packing", "--output", str(out),
            "--attention", "sdpa", "--target-modules", ",".join(TARGETS), "--lora-dropout", "0",
            # evaluated on the same file, so that no record is held out: both sides train on all of them
            "--eval-data", str(data)]  # fmt: skip


def run_dtrain(
    kind: str, ckpt: str, args: argparse.Namespace, model_dir: Path, data: Path, work: Path, env: dict
) -> dict:
    """dtrain's own training entry point (dtrain.lora.train.main, what `dtrain train lora` runs), in a
    worker of this script so that its fused kernels can be left out for the unfused pipeline."""
    out = work / f"runs-{kind}-{time.time_ns()}"
    cmd = [sys.executable, __file__, "--dtrain-worker", kind, "--warmup-steps", str(args.warmup_steps), "--",
           *dtrain_args(args, model_dir, data, out, ckpt)]  # fmt: skip
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
    facts = json.loads(next(ln for ln in reversed(text.splitlines()) if ln.startswith(WORKER_LINE))[len(WORKER_LINE) :])
    return {"tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / facts.pop("cpu_s"), "peak_rss_mib": rss,
            "steps_timed": len(timed), "fill_pct": fill_pct,
            "final_loss": next(r["loss"] for r in reversed(rows) if "loss" in r), **facts}  # fmt: skip


def probe_attention(calls: int = PROBE_CALLS) -> dict[str, Any]:
    """Watch torch's scaled_dot_product_attention (which transformers' sdpa attention calls) for its
    first `calls` calls with gradients on (training forwards and their recomputes; evaluation and
    dtrain's isolation check run without), then put it back. Returns a dict that the worker fills in
    and reports: how many calls passed a dense boolean mask, and whether every such mask is exactly a
    per-document causal mask (block-diagonal lower triangles), or `is_causal` without a mask; the row
    lengths, the documents per row, the share of a plain causal mask's pairs that were attended, and
    the CPU kernel torch picks for those inputs. Both sides report it, and main() refuses a race in
    which they differ."""
    import torch
    from torch.nn.attention import SDPBackend

    F = torch.nn.functional
    stock = F.scaled_dot_product_attention
    seen: dict[str, Any] = {"calls": 0, "kinds": {}, "lengths": [], "docs": [], "allowed": 0, "causal_pairs": 0,
                            "backends": [], "block_diagonal": True}  # fmt: skip

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):  # noqa: ANN001
        if torch.is_grad_enabled() and seen["calls"] < calls:
            seen["calls"] += 1
            n = query.shape[-2]
            if attn_mask is None:
                kind, docs, allowed = ("is_causal" if is_causal else "no mask"), 1, n * (n + 1) // 2
            elif attn_mask.dtype == torch.bool:
                kind, docs, allowed = f"dense bool mask {tuple(attn_mask.shape)[:2]} x L x L", 0, 0
                for m in attn_mask.reshape(-1, *attn_mask.shape[-2:]):
                    start = torch.ones(n, dtype=torch.bool)
                    start[1:] = ~m.diagonal(-1)  # a document starts where a token may not see the one before
                    doc = start.cumsum(0)
                    want = torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
                    seen["block_diagonal"] &= bool(torch.equal(m, want))
                    docs, allowed = max(docs, int(doc[-1])), allowed + int(m.sum())
            else:
                kind, docs, allowed = f"additive {attn_mask.dtype} mask", 0, 0
            seen["kinds"][kind] = seen["kinds"].get(kind, 0) + 1
            seen["lengths"].append(n)
            seen["docs"].append(docs)
            seen["allowed"] += allowed
            seen["causal_pairs"] += n * (n + 1) // 2
            choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
            if SDPBackend(choice).name not in seen["backends"]:
                seen["backends"].append(SDPBackend(choice).name)
            if seen["calls"] == calls:
                F.scaled_dot_product_attention = stock
        return stock(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = sdpa
    return seen


def attention_summary(seen: dict[str, Any]) -> dict[str, Any]:
    if not seen["calls"]:
        return {"sdpa_calls": 0}
    return {"sdpa_calls": seen["calls"], "masks": seen["kinds"], "per_document_causal": seen["block_diagonal"],
            "row_tokens": [min(seen["lengths"]), max(seen["lengths"])],
            "documents_per_row": round(statistics.mean(seen["docs"]), 1),
            "attended_share_of_causal": round(seen["allowed"] / seen["causal_pairs"], 3),
            "cpu_kernel": seen["backends"]}  # fmt: skip


def dtrain_worker(kind: str, warmup_steps: int, argv: list[str]) -> None:
    from dtrain.lora import train

    if kind == "dtrain-unfused":
        train.fuse_model = lambda model: {"lora_linears": 0, "rms_norms": 0, "attention": 0}
    seen, facts, clock = probe_attention(), {}, {"steps": 0, "cpu0": 0.0}
    stock_step = train.train_step

    def first_step(ctx, model, *a, **k):  # noqa: ANN001, ANN202 - the model as it trains, once; the CPU clock
        if not facts:
            base = model.get_base_model()
            facts.update(trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                         checkpointing=bool(base.is_gradient_checkpointing),
                         attn_implementation=base.config._attn_implementation)  # fmt: skip
        clock["steps"] += 1
        if clock["steps"] == warmup_steps + 1:
            clock["cpu0"] = time.process_time()
        out = stock_step(ctx, model, *a, **k)
        facts["cpu_s"] = time.process_time() - clock["cpu0"]  # every thread's CPU time, the timed steps
        return out

    train.train_step = first_step
    try:
        train.main(argv)
    finally:
        print(WORKER_LINE + json.dumps({**facts, "attention": attention_summary(seen)}), flush=True)


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
                clock["start"], clock["cpu0"] = time.perf_counter(), time.process_time()
            if clock["forwards"] > warm_forwards:  # padding-free: every position of the row is a real token
                clock["tokens"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class End(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock["end"], clock["cpu1"] = time.perf_counter(), time.process_time()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                clock["losses"].append(logs["loss"])

    trainer = Trainer(
        model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora, callbacks=[End()]
    )
    lengths = [sum(x) for x in trainer.train_dataset["seq_lengths"]]
    seen = probe_attention()
    trainer.train()
    base = trainer.model.get_base_model()  # Trainer turns checkpointing on (or not) as train() starts
    print(json.dumps({"tokens_per_s": clock["tokens"] / (clock["end"] - clock["start"]),
                      "tokens_per_cpu_s": clock["tokens"] / (clock["cpu1"] - clock["cpu0"]),
                      "steps_timed": args.steps - args.warmup_steps,
                      "fill_pct": 100 * sum(lengths) / (len(lengths) * args.seq_len),
                      "final_loss": clock["losses"][-1],
                      "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
                      "checkpointing": bool(base.is_gradient_checkpointing),
                      "attn_implementation": base.config._attn_implementation,
                      "attention": attention_summary(seen)}))  # fmt: skip


def packed_masks(att: dict[str, Any]) -> set[str]:
    return set(att["masks"]) - {"is_causal"}


def check_fair(row: str, kind: str, res: dict[str, Any], first: dict[str, Any] | None) -> None:
    """Refuse a run that did not get the work its row promises, or not the same work as the row's first
    run: checkpointing as the row says, transformers' sdpa attention, the same trainable parameters, and
    the same attention masks (per-document causal, dense) at the SDPA call."""
    want = ROWS[row] == "on"
    att = res["attention"]
    problems = []
    if res["checkpointing"] != want:
        problems.append(f"activation checkpointing is {'on' if res['checkpointing'] else 'off'}")
    if res["attn_implementation"] != "sdpa":
        problems.append(f"attention ran as {res['attn_implementation']}, not sdpa")
    if not att.get("sdpa_calls") or not att["per_document_causal"] or att["documents_per_row"] <= 1:
        problems.append(f"attention was not per-document causal over packed rows: {att}")
    if first is not None and res["trainable"] != first["trainable"]:
        problems.append(f"{res['trainable']:,} trainable parameters, against {first['trainable']:,}")
    # A row that holds one document is plain causal attention (transformers passes is_causal, no mask):
    # each side's sampler orders the same rows its own way, so the first calls may meet one on one
    # side only. The masks of packed rows must be of the same kind on both.
    if first is not None and packed_masks(att) != packed_masks(first["attention"]):
        problems.append(f"attention masks {att['masks']}, against {first['attention']['masks']}")
    if problems:
        raise SystemExit(f"row {row} {kind}: not the race's work: " + "; ".join(problems))


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
        dtrain_worker(args.dtrain_worker, args.warmup_steps, args.rest)
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
        by_row = {**trl_settings(args, "off"), "gradient_checkpointing": "False|True (by row)"}
        print(f"TRL SFTConfig: {by_row} + peft LoraConfig(r=8, lora_alpha=16, lora_dropout=0, "
              f"target_modules={TARGETS}); model attn sdpa, fp32")  # fmt: skip
        print(f"rows: {ROWS}; {args.threads} threads a process, one process each, CPU", flush=True)
        print(f"load average at the start (1, 5, 15 min): {os.getloadavg()}; {os.cpu_count()} CPUs", flush=True)
        for r in range(args.rounds):
            for row, kind in cells if r % 2 == 0 else list(reversed(cells)):  # neighbours in time
                ckpt = ROWS[row]
                if kind.startswith("dtrain"):
                    res = run_dtrain(kind, ckpt, args, model_dir, data, work, env)
                else:
                    res = run_trl(ckpt, args, model_dir, data, env)
                firsts = [rs[0] for (rw, _), rs in results.items() if rw == row and rs]
                check_fair(row, kind, res, firsts[0] if firsts else None)
                res["load_average"] = os.getloadavg()
                results[(row, kind)].append(res)
                print(f"round {r + 1} row {row} (checkpointing {ckpt}) {kind}: {res['tokens_per_s']:,.0f} tokens/s, "
                      f"peak RSS {res['peak_rss_mib']:,.0f} MiB, rows {res['fill_pct']:.1f}% full, "
                      f"{res['tokens_per_cpu_s']:,.0f} tokens/CPU-s, final loss {res['final_loss']:.4f}; "
                      f"load {res['load_average'][0]:.1f}", flush=True)  # fmt: skip
                if r == 0:
                    print(f"  {res['trainable']:,} trainable; attention: {res['attention']}", flush=True)
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    print(f"\nmedian of {args.rounds} round(s); seq_len {args.seq_len}, {ROWS_PER_STEP} rows of 1 a step, "
          f"{args.steps} steps ({args.warmup_steps} warmup), {args.threads} threads, fp32, CPU")  # fmt: skip
    print(f"{'row':<5}{'pipeline':<16}{'tokens/s':>10}{'tokens/CPU-s':>12}{'peak RSS MiB':>14}{'fill %':>8}"
          f"{'x TRL tokens/s':>16}{'x TRL CPU':>12}{'x TRL memory':>14}")  # fmt: skip
    summary = []
    for (row, kind), rs in results.items():
        keys = ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mib", "fill_pct")
        med = {k: statistics.median(x[k] for x in rs) for k in keys}
        trl = results.get((row, "trl"))
        ratio = cpu = mem = float("nan")
        if trl and kind != "trl":  # within each round, then the median of the rounds' ratios
            pairs = list(zip(rs, trl, strict=False))  # a cut-short race: the rounds both ran
            ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs)
            cpu = statistics.median(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for a, b in pairs)
            mem = statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in pairs)
        summary.append({"row": row, "checkpointing": ROWS[row], "pipeline": kind, **med, "x_trl_tokens_per_s": ratio,
                        "x_trl_tokens_per_cpu_s": cpu, "x_trl_memory": mem, "rounds": rs})  # fmt: skip
        print(f"{row:<5}{kind:<16}{med['tokens_per_s']:>10,.0f}{med['tokens_per_cpu_s']:>12,.0f}"
              f"{med['peak_rss_mib']:>14,.0f}{med['fill_pct']:>8.1f}{ratio:>16.2f}{cpu:>12.2f}"
              f"{mem:>14.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": summary}, indent=1))


if __name__ == "__main__":
    main()
