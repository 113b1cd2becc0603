"""Validation loss, shared by the training loop and `shardlab eval` (which needs no training code)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardlab.amp import autocast
from shardlab.config import Config
from shardlab.data import GlobalBatchSampler, collate
from shardlab.runtime import Runtime


@torch.no_grad()
def evaluate(model: nn.Module, dataset, cfg: Config, rt: Runtime, sampler_seed: int) -> float | None:
    """Mean loss over up to eval_batches global batches of the validation set, split over ranks."""
    t = cfg.train
    if dataset is None or len(dataset) < t.global_batch_size:
        return None  # not one whole global batch to split over the ranks
    was_training = model.training
    model.eval()
    per_rank = t.global_batch_size // rt.world_size
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, sampler_seed, shuffle=False)
    total = torch.zeros(2, device=rt.device)
    for b in range(min(t.eval_batches, sampler.steps_per_epoch)):
        idx = sampler.rank_indices(b, rt.rank, rt.world_size)
        for i in range(0, per_rank, t.micro_batch_size):
            x, y = collate(dataset, idx[i:i + t.micro_batch_size])
            with autocast(t.precision, rt.device):
                loss = model(x.to(rt.device), y.to(rt.device))
            total += torch.stack([loss.float() * len(x), torch.tensor(float(len(x)), device=rt.device)])
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()
