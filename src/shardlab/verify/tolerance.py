"""The tolerance verify compares with: from the dtype the step computes in and the model's size.

[Note: the tolerance and why]
An engine computes the same step as the reference in another order: per rank, then across
ranks; micro batches of other sizes. In precision u (unit roundoff: 2^-53 for float64, 2^-24
float32, 2^-8 bf16, 2^-11 fp16) a reordered sum of n similar terms moves by about u * sqrt(n)
relative (rounding errors add like a random walk). We take the model's parameter count P as
its size in that model: every error verify measures is a norm over a tensor (compare.py),
and rounding spreads over the P numbers a step produces. So

    tolerance = SAFETY * u * sqrt(P),   SAFETY = 1000

Measured noise floors sit near u * sqrt(P) (the reference against itself with its rows
reversed, 3 steps, AdamW; 2-core AMD EPYC, torch 2.13 CPU, 2026-11-23): gpt-tiny (P = 0.84M,
u sqrt(P) = 1.0e-13) 1.5e-13 in float64, 1.1e-4 in float32 (u sqrt(P) = 5.5e-5); the engines
themselves 1.6e-13 and 9.2e-5. The largest errors are parameter values after AdamW steps,
where a gradient that is zero in exact arithmetic (GPT's attention key bias) is rounding
noise that Adam divides by its epsilon, and they grow with the steps. So the tolerance is
~700x above the noise, while the faults verify looks for give errors of 1e-3 (BatchNorm
statistics per rank) to 1 (a gradient off by N): 1e7x above the float64 tolerance.

In bf16 or fp16 (`--dtype config` with mixed precision or autocast), u * sqrt(P) is already
near 1: no tolerance separates their rounding (gpt-tiny's gradients differ by 9e-2 from a
float32 reference, its AdamW updates by up to 0.9) from a fault. verify then reports the
table and calls the result inconclusive: float64, the default, is the proof.

The logged loss is summed in float32 by train_step whatever the model's dtype, so the loss
is compared within max(tolerance, LOSS_FLOOR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SAFETY = 1000.0
# train_step accumulates the loss in float32 over the micro batches and averages it over ranks:
# a few float32 roundings (measured: 1.0e-7 between engine and reference in float64 runs)
LOSS_FLOOR = 16 * 2.0**-24
# Above this no comparison can separate rounding from a fault (a gradient off by N = 2 gives 0.5)
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
    autocast's (float64 runs: autocast leaves float64 alone, mixed precision runs as fp64)."""
    from shardlab.amp import AUTOCAST_DTYPES
    from shardlab.engines.api import DTYPES

    dtypes = [v.dtype for v in initial_state.values() if v.is_floating_point()]
    if plan.dtype != "float64":
        dtypes.append(DTYPES[plan.engine["parallel"]["mixed_precision"]])
        dtypes.append(AUTOCAST_DTYPES.get(plan.engine["train"]["precision"], torch.float32))
    return max(dtypes, key=lambda d: UNIT_ROUNDOFF[d])


def tolerance_for(plan, ref_meta: dict) -> Tolerance:
    dtype = compute_dtype(plan, ref_meta["initial"])
    u, n = UNIT_ROUNDOFF[dtype], ref_meta["num_parameters"]
    name = str(dtype).removeprefix("torch.")
    return Tolerance(SAFETY * u * math.sqrt(n), name,
                     f"{SAFETY:g} x u({name}) {u:.2g} x sqrt({n} parameters); the loss within "
                     f"{max(SAFETY * u * math.sqrt(n), LOSS_FLOOR):.1e} (summed in float32)")
