"""A script of the kind users write around Hugging Face accelerate, with no dtrain code in it: an
`Accelerator` (DDP on gloo on CPU), a tiny regression model, `accelerator.save_state` every --save-every
steps into --output-dir/step_<N> (the newest --keep kept), and at start `accelerator.load_state` of
the newest one there, with the step counter registered for checkpointing. It runs under torchrun or
`accelerate launch` unchanged:

    torchrun --nproc-per-node 2 train.py --steps 40
    accelerate launch --num_processes 2 train.py --steps 40
"""

import argparse
import os
import shutil
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class Progress:
    """The step counter, saved and loaded with the model by save_state/load_state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a fixed linear target: the same for a given step on every start."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 8, generator=g)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1)


def saved_steps(folder: str) -> list[int]:
    """The steps of the checkpoints in `folder`, oldest first."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--output-dir", default="out")
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model, opt = accelerator.prepare(model, opt)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    saved = saved_steps(a.output_dir)
    if saved:
        accelerator.load_state(os.path.join(a.output_dir, f"step_{saved[-1]}"))
        accelerator.print(f"resumed at step {progress.step}", flush=True)
    accelerator.print(f"{accelerator.num_processes} processes, {accelerator.device}", flush=True)
    while progress.step < a.steps:
        x, y = batch(progress.step, accelerator.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        progress.step += 1
        total = accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.print(f"step {progress.step} loss {total:.4f}", flush=True)
        if progress.step % a.save_every == 0:
            accelerator.save_state(os.path.join(a.output_dir, f"step_{progress.step}"))
            if accelerator.is_main_process:
                for old in saved_steps(a.output_dir)[: -a.keep]:
                    shutil.rmtree(os.path.join(a.output_dir, f"step_{old}"))
        time.sleep(a.sleep)
    accelerator.wait_for_everyone()
    accelerator.print(f"done at step {progress.step}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
