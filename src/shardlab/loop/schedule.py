"""The optimizer (`make_optimizer`: AdamW or SGD over what the engine left this rank) and its
learning-rate schedule: linear warmup, then cosine decay to lr x min_lr_ratio.

[Note: the schedule on resume]
The schedule is part of the training state. `CosineSchedule` is an object rather than a
closure so that `LambdaLR.state_dict()` stores its fields (steps, warmup, floor) in every
checkpoint and `load_state_dict` restores them. A run resumed with another `train.steps` (to
train longer, say) therefore keeps the schedule it started with: past its end the rate stays at
lr x min_lr_ratio, instead of jumping to wherever a re-stretched cosine would be (raising
train.steps from 40 to 400 at step 40 would have moved the rate from its floor back to near its
peak in one step). `schedule_note` says so at the start of the run. A new schedule is a new run
(another output.run_name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shardlab.config import TrainConfig


@dataclass  # not frozen: LambdaLR.load_state_dict restores the fields of a checkpoint's schedule
class CosineSchedule:
    steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(t: TrainConfig, params) -> torch.optim.Optimizer:
    params = list(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    # foreach=False: the same kernels whatever the number or shape of the (sharded) tensors,
    # so every engine's update is the same arithmetic as single's.
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             foreach=False)


def make_schedule(t: TrainConfig, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, CosineSchedule(t.steps, t.warmup_steps, t.min_lr_ratio))


def schedule_note(t: TrainConfig, sched: torch.optim.lr_scheduler.LambdaLR) -> str | None:
    """After a resume: a line naming the schedule keys whose config value differs from the
    checkpoint's schedule, which is kept ([Note: the schedule on resume]); None when they agree."""
    kept = sched.lr_lambdas[0]
    changed = [f"train.{k}={getattr(t, k)} (the run's schedule: {getattr(kept, k)})"
               for k in ("steps", "warmup_steps", "min_lr_ratio") if getattr(t, k) != getattr(kept, k)]
    if not changed:
        return None
    return (f"note: {', '.join(changed)}: the learning-rate schedule is kept from the checkpoint, "
            f"so after step {kept.steps} the rate stays at lr x min_lr_ratio; for a new schedule, start "
            "a new run (output.run_name=...)")
