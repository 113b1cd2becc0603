"""Validation loss, shared by the training loop and `shardlab eval` (which needs no training code):
over the whole validation set, and per corpus of a mixture (data.mix, data/mixture.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardlab.config import TrainConfig
from shardlab.data import collate
from shardlab.engines import collectives
from shardlab.loop.loss import autocast, count_targets
from shardlab.loop.runtime import Runtime


@dataclass
class Evaluation:
    loss: float | None                      # over every evaluated target token; None: no validation row
    by_source: dict[str, float] = field(default_factory=dict)  # a mixture's corpora, by name: each one's own


def eval_rows(dataset, t: TrainConfig) -> int:
    """How many validation rows are evaluated: the first train.eval_batches global batches' worth,
    or every row when there are fewer."""
    if dataset is None:
        return 0
    return min(len(dataset), t.eval_batches * t.global_batch_size)


def _micro_batches(lo: int, hi: int, bounds: list[int], mb: int) -> list[tuple[int, int, int]]:
    """Rows [lo, hi) as (source, first, end) micro batches of at most mb rows, none crossing a
    source boundary (`bounds`: where each source's rows start, then the end)."""
    out = []
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        a, b = max(a, lo), min(b, hi)
        out += [(j, i, min(i + mb, b)) for i in range(a, b, mb)]
    return out


@torch.no_grad()
def evaluate_sources(model: nn.Module, dataset, t: TrainConfig, rt: Runtime) -> Evaluation:
    """The mean loss over every target token of the first `eval_rows` validation rows (in order),
    split over the ranks: token-weighted as the training loss ([Note: token-weighted loss] in
    loss.py), so the value does not depend on the world size or the micro batch size. A dataset
    of several sources side by side (`offsets` and `names`: data/mixture.py's MixtureWindows)
    also gives each source's own mean: a micro batch never mixes two sources."""
    rows = eval_rows(dataset, t)
    if rows == 0:
        return Evaluation(None)
    names = getattr(dataset, "names", None)
    bounds = [min(b, rows) for b in dataset.offsets] if names is not None else [0, rows]
    was_training = model.training
    model.eval()
    mb, world = t.micro_batch_size, rt.world_size
    slices = [_micro_batches(rows * r // world, rows * (r + 1) // world, bounds, mb) for r in range(world)]
    # every rank runs the same number of forwards (sharded engines gather parameters in each);
    # a rank whose slice ran out repeats a row and does not count it
    forwards = max(len(s) for s in slices)
    mine = slices[rt.rank]
    total = torch.zeros(len(bounds) - 1, 2, dtype=torch.float64, device=rt.device)  # per source: token losses, tokens
    for i in range(forwards):
        j, a, b = mine[i] if i < len(mine) else (0, 0, 1)
        x, y = collate(dataset, torch.arange(a, b))
        with autocast(t.precision, rt.device):
            loss = model(x.to(rt.device), y.to(rt.device))
        n = count_targets(y) if i < len(mine) else 0
        if n:
            total[j] += torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64, device=rt.device)])
    if rt.distributed and world > 1:
        collectives.all_reduce(total)  # through collectives: in the hang doctor's record
    model.train(was_training)
    total = total.cpu()
    overall = total.sum(0)
    by_source = {name: (t[0] / t[1]).item() for name, t in zip(names or [], total) if t[1] > 0}
    return Evaluation((overall[0] / overall[1]).item() if overall[1] > 0 else None, by_source)


def evaluate(model: nn.Module, dataset, t: TrainConfig, rt: Runtime) -> float | None:
    """evaluate_sources' loss over the whole validation set (None: no validation row)."""
    return evaluate_sources(model, dataset, t, rt).loss
