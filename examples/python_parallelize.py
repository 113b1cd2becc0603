"""Your own training loop around `shardlab.parallelize` (docs/python.md, "1. Your own loop").

    python -m torch.distributed.run --nproc-per-node 2 examples/python_parallelize.py [STRATEGY] [OUT_DIR]

Any key of shardlab.STRATEGIES as STRATEGY (default fsdp). Everything else is yours: the model,
the data, the loss, the loop, the checkpoints. shardlab gives the sharding, `no_sync` for
accumulation, the global gradient norm, and state dicts under the module's own names.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardlab


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def main(strategy: str, out_dir: str) -> None:
    dist.init_process_group("gloo")  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR come from it
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):  # only shapes: each rank materializes what it holds, initialized by seed
        model = make_model()
    model = shardlab.parallelize(model, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, 8))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world, rank, seed=0))
    accumulation = 2  # micro batches per optimizer step; only the last one communicates
    for i, (inputs, targets) in enumerate(loader):
        last = (i + 1) % accumulation == 0
        with contextlib.nullcontext() if last else shardlab.no_sync(model):  # backward inside it too
            loss = F.mse_loss(model(inputs).squeeze(-1), targets) / accumulation
            loss.backward()
        if last:
            norm = shardlab.clip_grad_norm_(model, 1.0)  # the norm over every rank's gradients
            opt.step()
            opt.zero_grad()
    if rank == 0:
        print(f"{strategy} on {world} ranks: last loss {loss.item() * accumulation:.4f}, grad norm {norm:.4f}")

    # A sharded checkpoint with torch.distributed.checkpoint: model.state_dict() has the module's
    # own names on every engine (DTensor values where the engine shards), so DCP saves each rank's part.
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(out_dir, "dcp"))
    restored = {"model": model.state_dict()}
    dcp.load(restored, checkpoint_id=os.path.join(out_dir, "dcp"))
    model.load_state_dict(restored["model"])

    # One file for a plain module: every rank gathers, rank 0 saves.
    full = shardlab.full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(out_dir, "model.pt"))
        plain = make_model()
        plain.load_state_dict(torch.load(os.path.join(out_dir, "model.pt")))
        print(f"saved {len(full)} tensors to {out_dir}/model.pt; a plain nn.Sequential loads them")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fsdp", sys.argv[2] if len(sys.argv) > 2 else "runs/python-parallelize")
