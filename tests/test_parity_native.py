"""torch-ddp and torch-fsdp match `single` on the same global batch: PyTorch's own engines pass
the same parity checks as shardlab's. One spawn per world size runs every case, and each case is
its own test (tests/plans.py). Float64 (see tests/parity.py) except a few float32 cases and the
bf16 comparison; the half-frozen models check that both take frozen and trainable parameters in
one unit."""

import pytest
import torch

from tests.parity import CASES, train_engine
from tests.plans import case_id, check_against_single, check_same_on_every_rank, plan_params, run_plan

STRATEGIES = ("torch-ddp", "torch-fsdp")
OPTIMIZERS = ("sgd", "adamw")


CLIP = 0.05  # small enough that every step clips: a wrong global norm changes the update


def _native_plan(world: int) -> dict:
    """Every case: key -> (function, args, kwargs) (tests/plans.py); the same at every world size."""
    plan = {(s, c, o): (train_engine, (c, s, o), {}) for s in STRATEGIES for c in CASES for o in OPTIMIZERS}
    for s in STRATEGIES:  # global-norm clipping, and gradient accumulation under no_sync
        plan[(s, "gpt", "sgd", "clip")] = (train_engine, ("gpt", s, "sgd"), {"clip": CLIP})
        plan[(s, "mlp", "sgd", "accumulate")] = (train_engine, ("mlp", s, "sgd"), {"micro_batches": 2})
        for o in OPTIMIZERS:  # frozen and trainable parameters in one unit
            plan[(s, "frozen", o)] = (train_engine, ("frozen", s, o), {})
        plan[(s, "gpt_frozen", "adamw", "clip")] = (train_engine, ("gpt_frozen", s, "adamw"), {"clip": CLIP})
        plan[(s, "gpt", "adamw", "fp32")] = (train_engine, ("gpt", s, "adamw"), {"dtype": torch.float32})
    # FSDP2 keeping parameters gathered from forward to backward (SHARD_GRAD_OP behaviour)
    plan[("torch-fsdp", "gpt", "sgd", "keep_gathered")] = (train_engine, ("gpt", "torch-fsdp", "sgd"),
                                                           {"reshard_after_forward": False})
    return plan


def _bf16_and_fp32(rank, world):
    return {mp: train_engine(rank, world, "gpt", "torch-fsdp", "adamw", steps=4, mixed_precision=mp,
                             dtype=torch.float32)[0]
            for mp in (None, "bf16")}


@pytest.mark.slow
@pytest.mark.parametrize("world,key", plan_params(_native_plan, (2, 3)))
def test_native_engines_match_single(spawned, world, key):
    results = spawned(run_plan, world, plan=_native_plan)
    label = case_id(world, key)
    check_against_single(_native_plan(world)[key], results[0][key], label)
    check_same_on_every_rank(results, key, label)


@pytest.mark.slow
def test_torch_fsdp_bf16_stays_close_to_fp32(spawned):
    losses = spawned(_bf16_and_fp32, 2)[0]
    assert losses["bf16"] != losses[None]  # the policy is in effect: bf16 rounding shows in the losses
    for fp32, bf16 in zip(losses[None], losses["bf16"]):
        assert abs(bf16 - fp32) < 1e-2 * abs(fp32), (losses[None], losses["bf16"])
