"""`ddp` equals single-process training on the same global batch.

One spawn per world size (1, 2, 3, 4) runs every case, and each case is its own test
(tests/plans.py): parity for the three parity cases with SGD and AdamW (models start on meta),
no_sync accumulation, activation checkpointing, bf16 gradient reduction, gradient clipping and
eval forwards (tests/custom_train.py), a model with half of each block frozen, and the
all-reduce traffic. Everything runs in float64 (tests/parity.py explains why) except the bf16
cases and a few float32 ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardlab
from tests.custom_train import check_custom, reference_custom, train_custom
from tests.minimal_cases import PARITY, check_minimal, minimal_runs
from tests.parity import CASES, DTYPE, F64_ATOL, GLOBAL_BATCH, assert_parity, build, train_engine
from tests.plans import case_id, check_against_single, check_same_on_every_rank, plan_params, run_plan

OPTIMIZERS = ("sgd", "adamw")


def accumulation_steps(world: int) -> int:
    """Micro batches per step that divide this rank's slice of the global batch."""
    b = GLOBAL_BATCH // world
    return 2 if b % 2 == 0 else 3


class ReuseNet(nn.Module):
    """Engines' awkward corners in one model: a unit called twice per forward, a parameter
    registered in two units (blocks[2].weight is blocks[0].weight), a frozen parameter, a
    unit whose parameters are all frozen (its input still needs a gradient), a layer never
    used (no gradient: its bucket / gradient buffer must still be reduced without hanging;
    SGD leaves it unchanged either way), and a start on a real device (no meta) with values
    from the global RNG."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
        self.blocks[2].weight = self.blocks[0].weight
        self.blocks[1].bias.requires_grad_(False)
        self.blocks[3].requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 8)

    def forward(self, x, targets=None):
        h = torch.tanh(self.inp(x))
        for i in (0, 3, 1, 0, 2):
            h = torch.tanh(self.blocks[i](h))
        out = self.head(h)
        return out if targets is None else F.cross_entropy(out, targets)


def _reuse_batch(step: int):
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def _reuse_model(rank: int) -> nn.Module:
    torch.manual_seed(7)
    model = ReuseNet().to(DTYPE)
    if rank > 0:  # the engine must make every rank start from rank 0's values
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def train_reuse(rank: int, world: int, strategy: str | None, steps: int = 3, **options) -> tuple[list[float], dict]:
    """SGD with momentum on ReuseNet; strategy=None: the single-process reference."""
    model = _reuse_model(rank) if strategy else _reuse_model(0)
    if strategy:
        model = shardlab.parallelize(model, strategy, device="cpu", **options)
    params = list(model.parameters())
    opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.3, momentum=0.9)
    b = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        x, y = _reuse_batch(step)
        x = x.to(DTYPE)
        if strategy:
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if strategy and world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / (world if strategy else 1))
    state = shardlab.full_state_dict(model) if strategy else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


FROZEN = ("frozen", "gpt_frozen")  # tests/parity.py FROZEN_CASES: half of each block frozen


def trainable_bytes(case_name: str) -> int:
    """Bytes of the trainable parameters of a case's model (in the harness dtype)."""
    params = {id(p): p for p in build(case_name, "meta").parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


# float32 cases (FLOAT32_TOL in tests/parity.py gives their tolerances and measured noise)
F32_CASES = (("gpt", "adamw"), ("mlp", "sgd"))


def _ddp_plan(world: int) -> dict:
    """Every case at this world size: key -> (function, args, kwargs) (tests/plans.py)."""
    plan: dict = {}
    for c in CASES:
        for o in OPTIMIZERS:
            plan[("parity", c, o)] = (train_engine, (c, "ddp", o), {})
        plan[("accumulate", c)] = (train_engine, (c, "ddp", "sgd"), {"micro_batches": accumulation_steps(world)})
        plan[("checkpointing", c)] = (train_engine, (c, "ddp", "adamw"), {"activation_checkpointing": True})
        # bf16 reduction of fp32 gradients: the realistic setting, compared with fp32 at 1e-2
        plan[("bf16", c)] = (train_engine, (c, "ddp", "adamw"), {"mixed_precision": "bf16", "dtype": torch.float32})
        # tiny buckets: many async all-reduces in flight at once, launched in bucket order
        plan[("small_buckets", c)] = (train_engine, (c, "ddp", "sgd"), {"bucket_size_bytes": 512})
    for c, o in F32_CASES:
        plan[("f32", c, o)] = (train_engine, (c, "ddp", o), {"dtype": torch.float32})
    for o in OPTIMIZERS:
        plan[("parity", "frozen", o)] = (train_engine, ("frozen", "ddp", o), {})
    plan[("accumulate", "frozen")] = (train_engine, ("frozen", "ddp", "sgd"), {"micro_batches": accumulation_steps(world)})
    plan[("parity", "gpt_frozen", "adamw")] = (train_engine, ("gpt_frozen", "ddp", "adamw"), {})
    for c in (*CASES, *FROZEN):
        plan[("custom", c)] = (train_custom, (c, "ddp", "adamw"), {})
    plan[("reuse",)] = (train_reuse, ("ddp",), {})
    plan[("reuse", "checkpointing")] = (train_reuse, ("ddp",), {"activation_checkpointing": True})
    plan[("minimal",)] = (minimal_runs, ("ddp",), {})
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("world,key", plan_params(_ddp_plan, (1, 2, 3, 4), only=lambda key: key[0] != "minimal"))
def test_ddp_matches_single(spawned, world, key):
    """One case at one world size against `single` (one spawn per world size runs them all)."""
    results = spawned(run_plan, world, plan=_ddp_plan)
    entry, got, label = _ddp_plan(world)[key], results[0][key], f"ddp/{case_id(world, key)}"
    if key[0] == "custom":
        c = key[1]
        check_custom(reference_custom(c, "adamw"), got, label, F64_ATOL)
        # the all-reduce payload is exactly the trainable gradients, once per step: frozen
        # parameters' gradients are neither computed nor sent
        all_reduce = got["comm"].get("all_reduce", {})
        assert got["grad_bytes"] == trainable_bytes(c), (c, got["grad_bytes"])
        assert all_reduce.get("payload_bytes") == 3 * trainable_bytes(c), (c, got["comm"])
        assert set(got["comm"]) == {"all_reduce"}, got["comm"]
    elif key[0] == "reuse":
        assert_parity(train_reuse(0, 1, None), got, label)
    else:
        check_against_single(entry, got, label)
    check_same_on_every_rank(results, key, label)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ddp_minimal_matches_single_and_ddp(spawned, world):
    """ddp-minimal in the same spawned workers: equal to `single` and to ddp (tests/minimal_cases.py)."""
    results = spawned(run_plan, world, plan=_ddp_plan)
    check_minimal([r[("minimal",)] for r in results], world, "ddp",
                  {(c, o): results[0][("parity", c, o)] for c, o in PARITY})
