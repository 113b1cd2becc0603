"""`zero3` equals single-process training on the same global batch, and holds 1/N of the
model state per rank.

One spawn per world size (1, 2, 3, 4) runs every case, and each case is its own test
(tests/plans.py): parity for the three
parity cases with SGD and AdamW (models start on meta), reshard_after_forward=False, no_sync
accumulation, activation checkpointing, bf16 mixed precision, gradient clipping, eval
forwards after training, a unit run twice and a parameter shared by two units, ranks that
own nothing, loading a full state dict, model-state bytes against ddp's, ownership
balance, broadcast/reduce traffic, and frozen and trainable parameters in one unit (parity,
traffic of trainable gradients only, freeing during backward). Float64 throughout (see
tests/parity.py) except the bf16 cases and a few float32 ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlab
from shardlab.engines import engine_of
from tests.custom_train import check_custom, reference_custom, train_custom
from tests.engine_internals import gathered_bytes
from tests.minimal_cases import PARITY, check_minimal, minimal_runs
from tests.parity import (
    CASES,
    DTYPE,
    F64_ATOL,
    GLOBAL_BATCH,
    assert_parity,
    batch,
    build,
    train_engine,
    train_reference,
)
from tests.plans import case_id, check_against_single, check_same_on_every_rank, plan_params, run_plan
from tests.test_engine_ddp import F32_CASES, FROZEN, accumulation_steps, train_reuse, trainable_bytes

OPTIMIZERS = ("sgd", "adamw")


class TwoTensors(nn.Module):
    """Two parameter tensors: at N=3 and N=4 some ranks own nothing at all."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, 3)])

    def forward(self, x, targets):
        return F.cross_entropy(self.layers[0](x), targets)


def train_two_tensors(rank: int, world: int, strategy: str | None, steps: int = 3) -> tuple[list[float], dict]:
    torch.manual_seed(3)
    model = TwoTensors().to(DTYPE)
    if strategy:
        model = shardlab.parallelize(model, strategy, device="cpu")
    params = list(model.parameters())
    # torch.optim refuses an empty parameter list; a rank that owns nothing has no optimizer
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9) if params else None
    b = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(5000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 7, generator=g).to(DTYPE), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
        if strategy:
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        if opt:
            opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if opt:
            opt.step()
        t = loss.detach().clone()
        if strategy and world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / (world if strategy else 1))
    state = shardlab.full_state_dict(model) if strategy else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


def train_backward_twice(rank: int, world: int, strategy: str | None) -> tuple[list[float], dict]:
    """Two backward passes through one graph (retain_graph=True) accumulate twice the gradient."""
    model = build("gpt", "meta" if strategy else "cpu")
    if strategy:
        model = shardlab.parallelize(model, strategy, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    b = GLOBAL_BATCH // world if strategy else GLOBAL_BATCH
    x, y = batch("gpt", 0)
    loss = model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    state = shardlab.full_state_dict(model) if strategy else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return [], state


def load_round_trip(rank: int, world: int, case: str = "gpt") -> dict:
    """Load single's trained weights into a fresh zero3 model: full_state_dict gives them
    back exactly and the forward matches single's."""
    _, ref_state = train_reference(case, "adamw")
    model = shardlab.parallelize(build(case, "meta"), "zero3", device="cpu")
    shardlab.load_full_state_dict(model, ref_state)
    x = batch(case, 7)[0]
    with torch.no_grad():
        out = model(x)
    layout = [(piece.name, tuple(piece.full_shape), piece.offset, piece.local_start, piece.numel, tuple(p.shape))
              for p, pieces in engine_of(model).shard_layout() for piece in pieces]
    return {"state": shardlab.full_state_dict(model), "out": out, "n_local": len(list(model.parameters())),
            "layout": layout}


def frozen_release(rank: int, world: int) -> dict:
    """The half-frozen model: which units still hold gathered storage when block 0's trainable
    fc2.weight gradient arrives in backward, and how much is gathered after backward."""
    model = shardlab.parallelize(build("frozen", "meta"), "zero3", device="cpu")
    engine = engine_of(model)
    blocks = [next(u for u in engine.unit_list if u.module is b) for b in model.blocks]
    seen: dict = {}

    def record(_leaf):
        seen["gathered"] = [gathered_bytes(engine, b) for b in model.blocks]

    def hook_fc2(_module, _args, _kwargs):  # runs after the engine's pre-hook, which gathered and bound
        pos = next(i for i, s in enumerate(blocks[0].slots) if s.name == "blocks.0.fc2.weight")
        blocks[0].bound.fulls[pos].register_post_accumulate_grad_hook(record)

    model.blocks[0].register_forward_pre_hook(hook_fc2, with_kwargs=True)
    b = GLOBAL_BATCH // world
    x, y = batch("frozen", 0)
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    return {"at_block0_grad": seen["gathered"], "after_backward": gathered_bytes(engine)}


def _zero3_plan(world: int) -> dict:
    """Every case at this world size: key -> (function, args, kwargs) (tests/plans.py)."""
    plan: dict = {}
    for c in (*CASES, "frozen"):
        for o in OPTIMIZERS:
            plan[("parity", c, o)] = (train_engine, (c, "zero3", o), {})
        plan[("keep_gathered", c)] = (train_engine, (c, "zero3", "sgd"), {"reshard_after_forward": False})
        plan[("accumulate", c)] = (train_engine, (c, "zero3", "sgd"), {"micro_batches": accumulation_steps(world)})
        plan[("checkpointing", c)] = (train_engine, (c, "zero3", "adamw"), {"activation_checkpointing": True})
    for c in CASES:
        plan[("bf16", c)] = (train_engine, (c, "zero3", "adamw"), {"mixed_precision": "bf16", "dtype": torch.float32})
    for c, o in F32_CASES:
        plan[("f32", c, o)] = (train_engine, (c, "zero3", o), {"dtype": torch.float32})
    plan[("parity", "gpt_frozen", "adamw")] = (train_engine, ("gpt_frozen", "zero3", "adamw"), {})
    for c in (*CASES, *FROZEN):
        plan[("custom", c)] = (train_custom, (c, "zero3", "adamw"), {})
    plan[("custom", "mlp", "keep_gathered")] = (train_custom, ("mlp", "zero3", "adamw"), {"reshard_after_forward": False})
    plan[("reuse",)] = (train_reuse, ("zero3",), {})
    plan[("reuse", "checkpointing")] = (train_reuse, ("zero3",), {"activation_checkpointing": True})
    plan[("reuse", "keep_gathered")] = (train_reuse, ("zero3",), {"reshard_after_forward": False})
    plan[("two_tensors",)] = (train_two_tensors, ("zero3",), {})
    plan[("backward_twice",)] = (train_backward_twice, ("zero3",), {})
    # looked at by their own tests below
    plan[("frozen_release",)] = (frozen_release, (), {})
    plan[("round_trip", "gpt")] = (load_round_trip, ("gpt",), {})
    plan[("round_trip", "frozen")] = (load_round_trip, ("frozen",), {})
    plan[("ddp", "gpt")] = (train_custom, ("gpt", "ddp", "adamw"), {})
    plan[("minimal",)] = (minimal_runs, ("zero3",), {})
    plan[("inflight_cap",)] = (inflight_caps, (), {})
    return plan


def inflight_caps(rank: int, world: int) -> dict:
    """[Note: how many reduces may be in flight]: the cap and what it is counted from, for fp32, a
    bf16 reduce of fp32 parameters, and half-frozen blocks."""
    out = {}
    for label, case, kwargs in (("fp32", "gpt", {}), ("bf16", "gpt", {"mixed_precision": "bf16"}),
                                ("frozen", "gpt_frozen", {})):
        engine = engine_of(shardlab.parallelize(build(case, "cpu", torch.float32), "zero3", device="cpu", **kwargs))
        trainable = [sum(s.numel for s in u.slots if s.requires_grad) for u in engine.unit_list]
        out[label] = (engine.max_inflight_bytes, max(trainable), max(engine.unit_param_bytes))
    return out


def _param_bytes(case: str) -> int:
    return sum(p.numel() * p.element_size() for p in build(case, "cpu").parameters())


def _check_round_trip(results: list, key: tuple, case: str) -> None:
    """Every rank's full state after load_full_state_dict equals single's trained state, its
    forward matches, and shard_layout holds every parameter (frozen ones too) whole, once."""
    _, ref_state = train_reference(case, "adamw")
    with torch.no_grad():
        ref_model = build(case, "cpu")
        ref_model.load_state_dict(ref_state)
        ref_out = ref_model(batch(case, 7)[0])
    names = dict(ref_model.named_parameters(remove_duplicate=True))
    assert sum(r[key]["n_local"] for r in results) == len(names)
    pieces = [piece for r in results for piece in r[key]["layout"]]
    assert sorted(p[0] for p in pieces) == sorted(names), pieces
    for name, full_shape, offset, local_start, numel, local_shape in pieces:
        assert (offset, local_start, full_shape, local_shape) == (0, 0, tuple(ref_state[name].shape), full_shape)
        assert numel == ref_state[name].numel()
    for r in results:
        assert_parity(([0.0], ref_state), ([0.0], r[key]["state"]), f"zero3/{case} load round trip", rtol=0, atol=0)
        torch.testing.assert_close(r[key]["out"], ref_out, rtol=1e-12, atol=1e-12)


WORLDS = (1, 2, 3, 4)
OWN_TESTS = ("frozen_release", "round_trip", "ddp", "minimal", "inflight_cap")  # keys checked by their own tests below
REFERENCES = {"reuse": lambda: train_reuse(0, 1, None), "two_tensors": lambda: train_two_tensors(0, 1, None),
              "backward_twice": lambda: train_backward_twice(0, 1, None)}


def _check_custom_traffic(c: str, got: dict, world: int) -> None:
    """Per step every parameter is broadcast twice (forward, backward; frozen ones included) and
    reduced once (trainable gradients only); once each with reshard_after_forward=False."""
    comm, params = got["comm"], _param_bytes(c)
    assert set(comm) == {"broadcast", "reduce"}, comm
    assert comm["reduce"]["payload_bytes"] == 3 * trainable_bytes(c), (c, comm)
    assert comm["broadcast"]["payload_bytes"] == 3 * 2 * params, (c, comm, params)
    for kind in ("broadcast", "reduce"):  # a chain: N-1 of N ranks forward each payload once
        expected = comm[kind]["payload_bytes"] * (world - 1) / world
        assert abs(comm[kind]["bus_bytes"] - expected) <= comm[kind]["calls"], (kind, comm)
    assert got["engine_info"]["gathered_bytes"] == 0, got["engine_info"]  # a forward without backward left nothing


@pytest.mark.slow
@pytest.mark.parametrize("world,key", plan_params(_zero3_plan, WORLDS, only=lambda key: key[0] not in OWN_TESTS))
def test_zero3_matches_single(spawned, world, key):
    """One case at one world size against `single` (one spawn per world size runs them all)."""
    results = spawned(run_plan, world, plan=_zero3_plan)
    entry, got, label = _zero3_plan(world)[key], results[0][key], f"zero3/{case_id(world, key)}"
    if key == ("custom", "mlp", "keep_gathered"):
        # one broadcast per step (forward only); what a forward without backward left gathered is
        # dropped by the next forward (the eval forwards of train_custom check the values)
        check_custom(reference_custom("mlp", "adamw"), got, label, F64_ATOL)
        mlp_bytes = _param_bytes("mlp")
        assert got["comm"]["broadcast"]["payload_bytes"] == 3 * mlp_bytes, got["comm"]
        assert got["comm"]["reduce"]["payload_bytes"] == 3 * mlp_bytes, got["comm"]
        assert got["engine_info"]["gathered_bytes"] == mlp_bytes, got["engine_info"]
    elif key[0] == "custom":
        check_custom(reference_custom(key[1], "adamw"), got, label, F64_ATOL)
        _check_custom_traffic(key[1], got, world)
    elif key[0] in REFERENCES:
        assert_parity(REFERENCES[key[0]](), got, label)
    else:
        check_against_single(entry, got, label)
    check_same_on_every_rank(results, key, label)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_zero3_frozen_units_freed_in_backward(spawned, world):
    """A unit with frozen parameters is freed in backward once its inputs' gradients are in:
    blocks 1 and 2 (inputs need a gradient) are free before block 0's gradients arrive; block 0
    (its input comes from a frozen layer) is held until the end of backward."""
    for r in spawned(run_plan, world, plan=_zero3_plan):
        at_block0 = r[("frozen_release",)]["at_block0_grad"]
        assert at_block0[0] > 0 and at_block0[1:] == [0, 0], at_block0
        assert r[("frozen_release",)]["after_backward"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["gpt", "frozen"])
def test_zero3_load_full_state_dict_round_trip(spawned, world, case):
    _check_round_trip(spawned(run_plan, world, plan=_zero3_plan), ("round_trip", case), case)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_zero3_holds_one_nth_of_ddps_model_state(spawned, world):
    """params + grads + AdamW state per rank is 1/N of ddp's plus at most one unit's worth; every
    byte is held by exactly one rank; ownership is balanced to within one tensor."""
    results = spawned(run_plan, world, plan=_zero3_plan)
    ddp_bytes = results[0][("ddp", "gpt")]["model_state_bytes"]
    zero3 = [r[("custom", "gpt")] for r in results]
    info = zero3[0]["engine_info"]
    unit_worth = 4 * max(info["unit_param_bytes"])  # param + grad + two Adam moments, all in the param dtype
    per_rank = [z["model_state_bytes"] for z in zero3]
    assert sum(per_rank) == ddp_bytes, (per_rank, ddp_bytes)
    for b in per_rank:
        assert b <= ddp_bytes / world + unit_worth, (per_rank, ddp_bytes, unit_worth)
    owned = info["owned_bytes"]
    largest = max(v.numel() * v.element_size() for v in train_reference("gpt", "sgd")[1].values())
    assert max(owned) - min(owned) <= largest, owned


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_zero3_inflight_cap_counts_the_buffers_bytes(spawned, world):
    """The reduces in flight are capped at twice the largest unit's gradient buffers, in the dtype
    they are reduced in: fp32 parameters reduced in bf16 get half the bytes (a cap in parameter bytes
    let twice the units through), and frozen parameters count nothing."""
    caps = spawned(run_plan, world, plan=_zero3_plan)[0][("inflight_cap",)]
    cap, numel, param_bytes = caps["fp32"]
    assert cap == 2 * 4 * numel == 2 * param_bytes
    assert caps["bf16"] == (2 * 2 * numel, numel, param_bytes)
    cap, numel, param_bytes = caps["frozen"]
    assert cap == 2 * 4 * numel < 2 * param_bytes


def test_zero3_rejects_unknown_option():
    with pytest.raises(TypeError, match="bucket_size_bytes"):
        shardlab.parallelize(build("mlp", "meta"), "zero3", bucket_size_bytes=1)


def _ownership_on_fake_group(case: str, world: int) -> list[dict]:
    """zero3 built on the meta device at every rank of a fake `world`-rank group (collectives
    return at once; the engine's own ownership and dropping run), in this process: per rank,
    the engine's bookkeeping and what the rank really holds."""
    import torch.distributed as dist

    from shardlab.plan.model import init_fake_group

    out = []
    for rank in range(world):
        init_fake_group(rank, world)
        try:
            engine = engine_of(shardlab.parallelize(build(case, "meta"), "zero3", device="meta"))
            local = engine.local_parameters()
            out.append({"owned_bytes": engine.owned_bytes,
                        "held": sum(p.numel() * p.element_size() for p in local),
                        "trainable": [p.numel() * p.element_size() for p in local if p.requires_grad]})
        finally:
            dist.destroy_process_group()
    return out


def test_owned_bytes_are_what_each_rank_holds():
    """Each rank's `owned_bytes` entry equals the bytes of the parameters it really holds (its
    local parameters), on every rank at N = 1..4, for an all-trainable model and a half-frozen
    one; and with at least as many trainable tensors as ranks every rank owns a trainable one,
    trainable bytes balanced to within one tensor. (The bookkeeping was only checked against
    itself: an owner moved by one rank passed every test at N = 1-3.)"""
    for case in ("gpt", "frozen", "gpt_frozen"):
        model = build(case, "meta")
        params = list({id(p): p for p in model.parameters()}.values())
        total = sum(p.numel() * p.element_size() for p in params)
        trainable = [p.numel() * p.element_size() for p in params if p.requires_grad]
        for world in (1, 2, 3, 4):
            ranks = _ownership_on_fake_group(case, world)
            for r, seen in enumerate(ranks):
                assert seen["owned_bytes"] == ranks[0]["owned_bytes"], (case, world, "ranks disagree")
                assert seen["owned_bytes"][r] == seen["held"], (case, world, r, seen)
            assert sum(ranks[0]["owned_bytes"]) == total, (case, world)
            assert len(trainable) >= world, (case, world, "the cases have enough trainable tensors")
            assert all(seen["trainable"] for seen in ranks), (case, world, [s["trainable"] for s in ranks])
            loads = [sum(seen["trainable"]) for seen in ranks]
            assert max(loads) - min(loads) <= max(trainable), (case, world, loads)


def test_ranks_without_trainable_tensors_are_named_when_built():
    """Fewer trainable tensors than ranks: the engine says, when it is built, which ranks own only
    frozen weights; fewer tensors than ranks: which own nothing (shardlab train then refuses)."""
    import torch.distributed as dist

    from shardlab.plan.model import init_fake_group

    def one_trainable() -> nn.Module:
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        for name, p in m.named_parameters():
            p.requires_grad_(name == "2.weight")
        return m

    for make, world, says in ((one_trainable, 2, r"rank\(s\) \[1\] own only frozen parameters"),
                              (TwoTensors, 3, r"rank\(s\) \[2\] own no parameter")):
        init_fake_group(0, world)
        try:
            with torch.device("meta"):
                model = make()
            with pytest.warns(UserWarning, match=says):
                shardlab.parallelize(model, "zero3", device="meta")
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_zero3_minimal_matches_single_and_zero3(spawned, world):
    """zero3-minimal in the same spawned workers: equal to `single` and to zero3 (tests/minimal_cases.py)."""
    results = spawned(run_plan, world, plan=_zero3_plan)
    check_minimal([r[("minimal",)] for r in results], world, "zero3",
                  {(c, o): results[0][("parity", c, o)] for c, o in PARITY})
