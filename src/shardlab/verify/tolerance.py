"""The tolerance verify compares with: from the dtype the step computes in and the model's size,
raised where the rounding measured in this very run asks for more.

[Note: the tolerance and why]
An engine computes the same step as the reference in another order: per rank, then across
ranks, in micro batches of other sizes. In precision u (unit roundoff: 2^-53 for float64, 2^-24
float32, 2^-8 bf16, 2^-11 fp16) a reordered sum of n similar terms moves by about u sqrt(n)
relative (rounding errors add like a random walk). Every error verify measures is a norm over
a tensor (compare.py), and rounding spreads over the P numbers a step produces, P the
model's parameter count. So the tolerance derived from dtype and size is

    SAFETY * u * sqrt(P),   SAFETY = 1000.

It is a model, and one quantity escapes it: AdamW divides each gradient element by
sqrt(v) + eps, so an element whose true gradient is zero (GPT's attention key bias: softmax
is shift-invariant) is rounding noise times lr / eps in the update. That noise grows with the
gradients' size, not with P. verify measures the noise of the run itself (the reference again
with each micro batch's rows reversed: the same maths, another rounding, runs.py), and the
tolerance is never less than NOISE_MARGIN = 100 times it:

    tolerance = max(SAFETY * u * sqrt(P), NOISE_MARGIN * noise floor).

Measured (float64, 3 steps; 2-core AMD EPYC VM, torch 2.13 CPU, 2026-11-23, after the
token-weighted loss; noise floor / largest engine error / tolerance; docs/verify.md has the
commands):
  gpt-tiny, AdamW (P = 0.84M)        7.7e-14 / 8.8e-14 / 1.0e-10   (size bound; 1300x the noise;
                                     error over ddp, zero3, fsdp, torch-ddp, torch-fsdp)
  resnet-cifar10 + sync BN, SGD      5.2e-14 / 4.8e-14 / 4.6e-11   (size bound; 890x; ddp)
  gpt-nano, AdamW (P = 36k)          2.6e-13 / 2.4e-13 / 2.6e-11   (noise bound: the Adam effect;
                                     measured before the merge, asserted by tests/test_verify.py)
The faults verify is for stand far above: BatchNorm statistics per rank 8.8e-3 at the first
BatchNorm's output and 0.99 in its running mean (resnet-cifar10, micro batch 32), a gradient off
by N 0.5 or more, a frozen parameter moving or a loss off by a factor: errors of order 1
(tests/test_verify.py): 10^7 times the float64 tolerances.

In float32 (`--dtype config`, ddp) gpt-tiny's noise floor is 1.1e-4, its largest error 5.2e-5 and
the tolerance 5.5e-2:
faults of order 1 are still seen, BatchNorm-sized ones are not. In bf16 or fp16, u sqrt(P) is
near 1: no tolerance tells their rounding (gpt-tiny's gradients differ by 9e-2 from a float32
reference, its AdamW updates by up to 0.9) from a fault; above USEFUL_LIMIT verify calls the
result inconclusive. float64, the default, is the proof.

The logged loss is summed in float32 by train_step whatever the model's dtype, so the loss is
compared within max(tolerance, LOSS_FLOOR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SAFETY = 1000.0
NOISE_MARGIN = 100.0
# train_step accumulates the loss in float32 over the micro batches and averages it over ranks:
# a few float32 roundings (measured: 1.0e-7 between engine and reference in float64 runs)
LOSS_FLOOR = 16 * 2.0**-24
# Above this no comparison separates rounding from a fault (a gradient off by N = 2 gives 0.5)
USEFUL_LIMIT = 0.1


@dataclass(frozen=True)
class Tolerance:
    value: float
    dtype_name: str
    why: str

    def for_loss(self) -> float:
        return max(self.value, LOSS_FLOOR)

    @property
    def useful(self) -> bool:
        return self.value <= USEFUL_LIMIT


def compute_dtype(plan, initial_state: dict) -> torch.dtype:
    """The least precise dtype the step computes in: the parameters', the engine's mixed precision,
    autocast's (in float64 runs autocast leaves float64 alone and mixed precision runs as fp64)."""
    from shardlab.engines.api import DTYPES
    from shardlab.loop.loss import AUTOCAST_DTYPES

    dtypes = [v.dtype for v in initial_state.values() if v.is_floating_point()]
    if plan.dtype != "float64":
        dtypes.append(DTYPES[plan.engine["parallel"]["mixed_precision"]])
        if plan.engine["parallel"].get("reduce_dtype"):
            dtypes.append(DTYPES[plan.engine["parallel"]["reduce_dtype"]])
        dtypes.append(AUTOCAST_DTYPES.get(plan.engine["train"]["precision"], torch.float32))
    return max(dtypes, key=lambda d: UNIT_ROUNDOFF[d])


def tolerance_for(plan, ref_meta: dict, noise_floor: float | None, island: torch.dtype | None = None) -> Tolerance:
    """`island`: the dtype a module still computed in inside a float64 run ([Note: float32 islands in
    a float64 run] in verify/float64.py): that rounding is in both runs, so it sets the tolerance."""
    dtype = compute_dtype(plan, ref_meta["initial"])
    if island is not None and UNIT_ROUNDOFF[island] > UNIT_ROUNDOFF[dtype]:
        dtype = island
    u, n = UNIT_ROUNDOFF[dtype], ref_meta["num_parameters"]
    name = str(dtype).removeprefix("torch.")
    size_bound = SAFETY * u * math.sqrt(n)
    noise_bound = NOISE_MARGIN * noise_floor if noise_floor is not None else 0.0
    value = max(size_bound, noise_bound)
    why = f"{SAFETY:g} x u({name}) x sqrt({n} parameters) = {size_bound:.1e}"
    why += (f", {NOISE_MARGIN:g} x the noise floor = {noise_bound:.1e}" if noise_floor is not None else
            ", the noise floor not measured")
    return Tolerance(value, name, f"the larger of {why}; the loss within {max(value, LOSS_FLOOR):.1e} "
                                  "(train_step sums it in float32)")
