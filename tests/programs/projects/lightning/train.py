"""A script of the kind users write around PyTorch Lightning's Trainer, with no dtrain code in it: a
LightningModule with a tiny regression model, DDP on CPU (strategy="ddp", gloo), a ModelCheckpoint
saving every --save-every steps into --output-dir (and last.ckpt), and `trainer.fit(ckpt_path="last")`,
which carries on from last.ckpt when there is one. Started by torchrun, Lightning takes the world from
torchrun's variables (its TorchElasticEnvironment); --devices and --num-nodes default to that world:

    torchrun --nproc-per-node 2 train.py --steps 40
"""

import argparse
import os
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint


class Points(torch.utils.data.Dataset):
    """A fixed linear target, made from a seed: 320 rows, 10 steps an epoch on 2 processes (batches of 16)."""

    def __init__(self, n: int = 320) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.arange(1.0, 9.0).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Regression(pl.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.sleep = sleep

    def on_train_start(self) -> None:
        if self.global_step:
            self.print(f"resumed at step {self.global_step}", flush=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        total = self.all_gather(loss.detach()).mean().item()
        self.print(f"step {self.global_step + 1} loss {total:.4f}", flush=True)
        time.sleep(self.sleep)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


def main() -> None:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--output-dir", default="out")
    p.add_argument("--devices", type=int, default=local)
    p.add_argument("--num-nodes", type=int, default=int(os.environ.get("WORLD_SIZE", "1")) // local)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()

    pl.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=a.output_dir, every_n_train_steps=a.save_every, save_top_k=2,
                                  monitor="step", mode="max", save_last=True)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.devices,
        num_nodes=a.num_nodes,
        strategy="ddp",
        max_steps=a.steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(Points(), batch_size=16, shuffle=True)
    trainer.fit(Regression(a.sleep), data, ckpt_path="last")
    trainer.print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
