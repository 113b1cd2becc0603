"""Validation loss, shared by the training loop and `shardlab eval` (which needs no training code)."""

from __future__ import annotations

import torch
from torch import nn

from shardlab.config import TrainConfig
from shardlab.data import collate
from shardlab.engines import collectives
from shardlab.loop.amp import autocast
from shardlab.loop.loss import count_targets
from shardlab.loop.runtime import Runtime


def eval_rows(dataset, t: TrainConfig) -> int:
    """How many validation rows are evaluated: the first train.eval_batches global batches' worth,
    or every row when there are fewer."""
    if dataset is None:
        return 0
    return min(len(dataset), t.eval_batches * t.global_batch_size)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, t: TrainConfig, rt: Runtime) -> float | None:
    """The mean loss over every target token of the first `eval_rows` validation rows (in order),
    split over the ranks: token-weighted as the training loss ([Note: token-weighted loss] in
    loss.py), so the value does not depend on the world size or the micro batch size.
    None: no validation row."""
    rows = eval_rows(dataset, t)
    if rows == 0:
        return None
    was_training = model.training
    model.eval()
    mb = t.micro_batch_size
    lo, hi = rows * rt.rank // rt.world_size, rows * (rt.rank + 1) // rt.world_size
    # every rank runs the same number of forwards (sharded engines gather parameters in each);
    # a rank whose slice ran out repeats a row and does not count it
    most = -(-rows // rt.world_size)  # the largest slice
    forwards = -(-most // mb)
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # sum of token losses, tokens
    for i in range(forwards):
        idx = torch.arange(lo + i * mb, min(lo + (i + 1) * mb, hi))
        x, y = collate(dataset, idx if len(idx) else torch.tensor([0]))
        with autocast(t.precision, rt.device):
            loss = model(x.to(rt.device), y.to(rt.device))
        n = count_targets(y) if len(idx) else 0
        if n:
            total += torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64, device=rt.device)])
    if rt.distributed and rt.world_size > 1:
        collectives.all_reduce(total)  # through collectives: in the hang doctor's record
    model.train(was_training)
    return (total[0] / total[1]).item() if total[1] > 0 else None
