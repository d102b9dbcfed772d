"""A script of the kind users write around Hugging Face's Trainer, with no dtrain code in it: a tiny
Llama built from a config (no weights to download), a synthetic token dataset made from a seed (no
tokenizer, no data to download), checkpoints in --output-dir every --save-steps, and a restart that
carries on from the newest one there. It runs alone or under torchrun (DDP on gloo) unchanged:

    python train.py --max-steps 60
    torchrun --nproc-per-node 2 train.py --output-dir out

At the end it prints "final digest <sha256> sum <float>" of the weights, so
an interrupted-and-resumed run can be compared with an uninterrupted one.
"""

import argparse
import hashlib
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

VOCAB, SEQ = 256, 32


class TokenRuns(torch.utils.data.Dataset):
    """Sequences that count up from a random start by a random stride (mod VOCAB): learnable by a tiny
    model, the same for a given seed on every process."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Slow(TrainerCallback):
    """Waits after each step (tests use it to have time to interrupt a run mid-way)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def digest(model: torch.nn.Module) -> tuple[str, float]:
    """The weights' bytes hashed in name order, and their sum."""
    h, total = hashlib.sha256(), 0.0
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().float().contiguous().cpu()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
        total += t.double().sum().item()
    return h.hexdigest(), total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="out")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()

    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        save_total_limit=2,
        per_device_train_batch_size=a.batch_size,
        learning_rate=a.lr,
        warmup_steps=5,
        logging_steps=10,
        use_cpu=True,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TokenRuns(a.examples, seed=1),
        callbacks=[Slow(a.sleep)] if a.sleep else [],
    )
    last = get_last_checkpoint(a.output_dir) if os.path.isdir(a.output_dir) else None
    if last and trainer.is_world_process_zero():
        print(f"resumed from {last.rsplit('/', 1)[-1]}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        sha, total = digest(trainer.model)
        print(f"final digest {sha} sum {total:.6f}", flush=True)
    # As torchrun scripts should: a process group left to the interpreter's exit can abort in gloo's teardown
    # ("terminate called without an active exception", SIGABRT), failing a run that has finished.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
