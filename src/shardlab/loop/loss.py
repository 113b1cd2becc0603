"""The loss of a step and the precision it is computed in. The loss is token-weighted: the mean
over every target token of its global batch, whatever the world size, the micro batch size and
the engine. The precision is train.precision's: autocast, and for fp16 a loss scaler.

[Note: token-weighted loss]
A model's forward returns the mean loss over its micro batch's targets (the targets that are
not IGNORE_INDEX, -100: masked prompts, padding). Averaging those means (over a rank's micro
batches, then over ranks, as the engines average gradients) gives each micro batch the same
weight whatever its number of target tokens. With SFT rows of 4 and of 216 target tokens the
same global batch then has a different loss and gradient in each (world size, micro batch)
layout, and a token of a short micro batch weighs up to 54x a token of a long one. (transformers
fixed the same flaw in 4.46: its Trainer counts `num_items_in_batch` over the accumulated batch.)

So before the forward passes of a step every rank counts the target tokens n_i of each of its
micro batches, and one all-reduce gives G, the target tokens of the whole global batch. The
backward of micro batch i uses

    loss_i * n_i * N / G            (loss_i: the model's mean over its n_i targets, N: world size)

= (sum of micro batch i's per-token losses) * N / G. The engines average gradients over the N
ranks ([Note: why average] in engines/api.py), so the step's gradient is the gradient of (sum
over all G target tokens) / G: the same for every engine, world size and accumulation. The
reported loss is the sum of these terms over micro batches and ranks, divided by N: the same
global token mean.

Pretraining on fixed-length windows counts every target, so n_i * N / G = 1 / k (k micro
batches per rank), the factor used before. The weight is kept as a reduced fraction and applied
as `loss * numerator / denominator`, so that case still computes `loss / k`, bit for bit.

A micro batch with no target at all (only hand-made data has one: SFT preparation drops rows
without a target) has a NaN mean; it contributes zero loss and zero gradient, and still runs its
backward, since the engines communicate in backward.

Mixed precision: the autocast context and the fp16 loss scaler. bf16 has fp32's exponent range,
so it needs no scaling. fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero and the
update silently vanishes (the common case for a language model's small gradients). A dynamic
loss scaler multiplies the loss by S (default 2**16) before backward, divides the gradients by S
after it, and skips the step when a gradient overflowed, halving S; after `growth_interval` good
steps in a row it doubles S again.

[Note: one verdict for all ranks]
With sharded gradients (fsdp, zero3, torch-fsdp) each rank sees only its own slice, so one
rank may see an inf that the others do not. If ranks disagreed, some would step and some
would not, and the replicas would drift apart for ever. torch's `ShardedGradScaler` sums
the found-inf flag over the process group (one tiny all-reduce) before deciding; we use it
for every distributed engine, replicated ones included (there it costs one scalar). A rank that
holds no trainable gradient (a zero3 rank owning only frozen tensors) takes part too: torch's
`ShardedGradScaler._unscale_grads_` creates a zero flag on the scale's device when a rank has
no gradient (read in torch 2.13's source; the same code is in releases since at least 2.3, and
shardlab requires >= 2.6), so such a rank joins the all-reduce instead of leaving the others
waiting. tests/test_amp.py runs that case (zero3, one rank owning only frozen weights).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction

import torch

from shardlab.engines import collectives
from shardlab.models.lm_loss import IGNORE_INDEX  # noqa: F401  (this module's API too: the models' one value)


def count_targets(targets: torch.Tensor) -> int:
    """Target tokens (or samples, for class labels) that count in the loss."""
    return int((targets != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class TokenWeights:
    """How one rank's micro-batch losses enter the step (see [Note: token-weighted loss])."""

    counts: tuple[int, ...]   # this rank's target tokens, per micro batch
    total: int                # the global batch's target tokens, all ranks
    world_size: int

    def scale(self, loss: torch.Tensor, i: int) -> torch.Tensor:
        """Micro batch i's mean loss -> the term its backward uses: loss * n_i * N / G."""
        n = self.counts[i]
        if n == 0 or self.total == 0:
            return loss.nan_to_num() * 0  # the mean over no target is NaN; nothing to learn here
        w = Fraction(n * self.world_size, self.total)
        return loss * w.numerator / w.denominator


def token_weights(targets: list[torch.Tensor], world_size: int, device: torch.device | str,
                  distributed: bool) -> TokenWeights:
    """Count each micro batch's targets (on the host, before any forward) and all-reduce the
    total once: the step's only extra collective, one int64."""
    counts = tuple(count_targets(y) for y in targets)
    total = sum(counts)
    if distributed and world_size > 1:
        box = torch.tensor([total], dtype=torch.int64, device=device)
        collectives.all_reduce(box)  # through collectives: in the hang doctor's record (docs/debugging.md)
        total = int(box.item())
    return TokenWeights(counts, total, world_size)


def mean_over_ranks(value: torch.Tensor, world_size: int, distributed: bool) -> torch.Tensor:
    """The ranks' values averaged (the logged loss: the sum of a rank's weighted terms, over N)."""
    if distributed and world_size > 1:
        collectives.all_reduce(value)  # through collectives: in the hang doctor's record
        value = value / world_size
    return value


# -- the precision: autocast and the fp16 loss scaler ------------------------------------------------
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """train.precision as a context: fp32 runs as written, bf16/fp16 under torch.autocast."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def make_loss_scaler(fp16: bool, device: torch.device, distributed: bool, *, init_scale: float,
                     growth_interval: int) -> torch.amp.GradScaler | None:
    """The scaler for an fp16 run (None otherwise): agreeing across ranks when distributed."""
    if not fp16:
        return None
    if distributed:
        # deferred: torch.distributed.fsdp (and DTensor under it) costs a worker ~0.5 CPU-s to
        # import, and only a distributed fp16 run needs it
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, init_scale=init_scale, growth_interval=growth_interval)
    return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
