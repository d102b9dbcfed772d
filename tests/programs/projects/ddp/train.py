"""A training script of the kind users write for torchrun, with no dtrain code in it: DDP on gloo, a
checkpoint file of its own under --ckpt-dir (saved every --ckpt-every steps, loaded at start when
present), a config file and a data file read from the working directory, and a plain print per step.

    torchrun --nproc-per-node 2 train.py --steps 60 --ckpt-dir checkpoints
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-dir", default="checkpoints")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--config", default="configs/model.json")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(a.config) as f:
        cfg = json.load(f)
    data = torch.load("data/points.pt")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(cfg["inputs"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    step = 0
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    x, y = data["x"][rank::world], data["y"][rank::world]
    while step < a.steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step % a.ckpt_every == 0:
                os.makedirs(a.ckpt_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path)
        time.sleep(a.sleep)
    if rank == 0:
        w = model.module.weight.detach().flatten().tolist()
        print("final weights " + json.dumps([round(v, 6) for v in w]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
