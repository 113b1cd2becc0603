"""A parity file's cases as data, so that one spawn per world size runs them all and each case is
still its own test.

`plan(world)` returns {key: (function, args, kwargs)}: the spawned workers run
`run_plan(rank, world, plan)` (each function called as function(rank, world, *args, **kwargs));
`plan_params(plan, worlds)` gives one pytest parameter per (world, key), whose id `-k` selects
(`N2-accumulate-gpt`); each test takes its key's result from `conftest.spawned`, which spawns once
per world size. `check_against_single` compares a `parity.train_engine` run with `single`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.parity import DTYPE, assert_parity, tolerance, train_engine, train_reference

Plan = Callable[[int], dict[tuple, tuple[Callable, tuple, dict]]]


def run_plan(rank: int, world: int, plan: Plan) -> dict[tuple, Any]:
    return {key: fn(rank, world, *args, **kwargs) for key, (fn, args, kwargs) in plan(world).items()}


def case_id(world: int, key: tuple) -> str:
    return "-".join([f"N{world}", *(str(k) for k in key)])


def plan_params(plan: Plan, worlds: tuple[int, ...], only: Callable[[tuple], bool] = lambda key: True) -> list:
    params = [pytest.param(world, key, id=case_id(world, key)) for world in worlds for key in plan(world) if only(key)]
    assert len({p.id for p in params}) == len(params), "two cases share a test id"
    return params


@functools.cache
def reference(case: str, opt: str, clip: float | None = None, dtype: torch.dtype = DTYPE):
    return train_reference(case, opt, clip=clip, dtype=dtype)


def check_against_single(entry: tuple[Callable, tuple, dict], got: tuple, label: str) -> None:
    """A train_engine run (args: case, strategy, optimizer) against `single` on the same global
    batch: float64 at the parity tolerance, float32 at FLOAT32_TOL, bf16 mixed precision's losses
    within 1e-2 of float32's."""
    fn, (case, _strategy, opt), kwargs = entry
    assert fn is train_engine, f"{label}: not a train_engine run"
    dtype = kwargs.get("dtype", DTYPE)
    ref = reference(case, opt, kwargs.get("clip"), dtype)
    if kwargs.get("mixed_precision") == "bf16":
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=0, atol=1e-2,
                                   msg=lambda m: f"{label}: bf16 losses drift from fp32's\n{m}")
    else:
        assert_parity(ref, got, label, **tolerance(opt, dtype))


def check_same_on_every_rank(results: list[dict], key: tuple, label: str) -> None:
    """Every rank reports rank 0's losses and full parameters exactly."""
    got = results[0][key]
    for r in range(1, len(results)):
        other = results[r][key]
        if isinstance(got, tuple):  # (losses, state) from train_engine
            assert_parity(got, other, f"{label} rank {r} vs rank 0", rtol=0, atol=0)
        elif isinstance(got, dict) and "state" in got:
            assert_parity((got.get("losses", []), got["state"]), (other.get("losses", []), other["state"]),
                          f"{label} rank {r} vs rank 0", rtol=0, atol=0)
