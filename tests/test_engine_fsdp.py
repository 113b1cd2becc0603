"""The from-scratch FSDP engine equals single-process training, and really shards.

One spawn per world size runs every case (process start-up dominates here); each case is
then its own test (`-k N2-custom-frozen`), which compares its result with `single`'s,
computed in the parent. Float64 throughout (see
tests/parity.py) except the bf16 cases, a few float32 ones and the byte accounting (fp32,
so the numbers read as in docs/engines.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardlab
from shardlab.engines import engine_of, optimizer_state_bytes
from shardlab.models import count_parameters
from shardlab.models.init import INIT_STD_ATTR, init_parameters_
from tests.custom_train import check_custom, reference_custom, train_custom
from tests.engine_internals import gathered_bytes
from tests.minimal_cases import check_minimal, minimal_runs
from tests.parity import (
    CASES,
    DTYPE,
    F64_ATOL,
    GLOBAL_BATCH,
    assert_parity,
    batch,
    build,
    set_mode,
    tolerance,
    train_engine,
    train_reference,
)

OPTIMIZERS = ("sgd", "adamw")


# -- a model that breaks naive engines: a unit called twice, a tie across two units ---------------
class TwiceAndTied(nn.Module):
    def __init__(self, seed: int = 5):
        super().__init__()
        self.init_seed = seed
        self.inp = nn.Linear(6, 10)
        self.shared = nn.Linear(10, 10)   # a unit, called twice per forward
        self.a = nn.Linear(10, 10)        # a unit
        self.b = nn.Linear(10, 10)        # a unit whose weight is tied to a's
        self.b.weight = self.a.weight
        self.out = nn.Linear(10, 3)
        for m in self.modules():  # healthy gradients: Adam turns float noise on ~0 gradients into lr-sized steps
            setattr(m, INIT_STD_ATTR, 0.4)
        if self.inp.weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, x, targets=None):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        y = self.out(h)
        return y if targets is None else nn.functional.cross_entropy(y, targets)


def _twice_wrap(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and m.in_features == 10 and m.out_features == 10


def _twice_batch(step: int):
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def _build(case: str, device: str, dtype: torch.dtype = DTYPE) -> nn.Module:
    if case == "twice":
        with torch.device(device):
            return TwiceAndTied().to(dtype)
    return build(case, device, dtype)


def _batch(case: str, step: int, dtype: torch.dtype = DTYPE):
    if case == "twice":
        x, y = _twice_batch(step)
        return x.to(dtype), y
    return batch(case, step, dtype)


def _idle(engine) -> dict:
    """What fsdp holds after a no-grad forward: nothing should stay gathered or armed for a backward."""
    return {"gathered": gathered_bytes(engine),
            "armed": engine._backward_end.queued or any(
                not u.state.idle or u.storage.value != "sharded" for u in engine.flat_units)}


def _custom(rank: int, world: int, case: str, opt: str, options: dict) -> dict:
    """custom_train.train_custom for fsdp: no clipping unless the case asks, the "twice" model's
    units, and what stays gathered after each eval forward."""
    options = {"clip": None, **options}
    if case == "twice":
        options.setdefault("wrap", _twice_wrap)
    return train_custom(rank, world, case, "fsdp", opt, probe=_idle, make_model=_build, make_batch=_batch, **options)


# -- checks that look inside the engine --------------------------------------------------------
def _resharding(rank: int, world: int) -> dict:
    """Bytes of gathered unit storage after forward and after backward, both settings."""
    out = {}
    for raf in (True, False):
        model = shardlab.parallelize(_build("gpt", "meta"), "fsdp", device="cpu", reshard_after_forward=raf)
        engine = engine_of(model)
        x, y = _batch("gpt", 0)
        loss = model(x, y)
        after_fwd = [sum(g.full_data.untyped_storage().nbytes() for g in u.groups) for u in engine.wrap_units]
        loss.backward()
        after_bwd = gathered_bytes(engine)
        out[raf] = (after_fwd, [sum(g.full.numel() * g.full.element_size() for g in u.groups)
                                for u in engine.wrap_units], after_bwd)
    return out


def _memory_and_traffic(rank: int, world: int) -> dict:
    """One AdamW step in fp32: model-state bytes and what was all-gathered and reduce-scattered,
    with the padded sizes of the trainable and the frozen groups to check them against."""
    out = {}
    for case, options in (("gpt", {}), ("mlp", {}), ("gpt+checkpointing", {"activation_checkpointing": True}),
                          ("frozen", {})):
        name = case.split("+")[0]
        model = shardlab.parallelize(_build(name, "meta", torch.float32), "fsdp", device="cpu", **options)
        set_mode(model, name)
        engine = engine_of(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        b = GLOBAL_BATCH // world
        x, y = _batch(name, 0, torch.float32)
        before = engine.comm_stats()
        model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
        after = engine.comm_stats()
        opt.step()
        state = engine.model_state_bytes()
        root = engine.root_unit.groups if engine.root_unit is not None else []
        out[case] = {
            "state_bytes": state["params"] + state["grads"] + optimizer_state_bytes(opt),
            "padded": sum(g.full.numel() for g in engine.groups),
            "trainable_padded": sum(g.full.numel() for g in engine.groups if g.trainable),
            "trainable_groups": sum(g.trainable for g in engine.groups),
            "groups": len(engine.groups),
            "root_padded": sum(g.full.numel() for g in root),
            "gather": after["all_gather"]["payload_bytes"] - before.get("all_gather", {}).get("payload_bytes", 0),
            "reduce": after["reduce_scatter"]["payload_bytes"] - before.get("reduce_scatter", {}).get("payload_bytes", 0),
            "reduce_calls": after["reduce_scatter"]["calls"] - before.get("reduce_scatter", {}).get("calls", 0),
        }
    return out


def _frozen_release(rank: int, world: int) -> dict:
    """The half-frozen model: each block's state when block 0's trainable group gets its
    gradient in backward, and what is gathered after backward."""
    model = shardlab.parallelize(_build("frozen", "meta"), "fsdp", device="cpu")
    engine = engine_of(model)
    seen: dict = {}
    block0 = next(u for u in engine.wrap_units if u.module is model.blocks[0])
    trainable = next(g for g in block0.groups if g.trainable)

    def record(_full: torch.Tensor) -> None:
        seen.setdefault("states", [u.storage.value for u in engine.wrap_units])

    trainable.full.register_post_accumulate_grad_hook(record)  # after the engine's own hook on it
    b = GLOBAL_BATCH // world
    x, y = _batch("frozen", 0)
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    shards = {name: (p.requires_grad, p.grad is None) for name, p in model.named_parameters()}
    return {"states": seen["states"], "after_backward": gathered_bytes(engine), "shards": shards}


def _layouts(rank: int, world: int) -> dict:
    """This rank's shard_layout for each case, whether each piece holds the values the full
    state dict has there, and whether a full state dict loads back exactly."""
    out = {}
    for case in (*CASES, "twice", "frozen"):
        kw = {"wrap": _twice_wrap} if case == "twice" else {}
        model = shardlab.parallelize(_build(case, "meta"), "fsdp", device="cpu", **kw)
        full = shardlab.full_state_dict(model)
        pieces, values_ok = [], True
        for param, plist in engine_of(model).shard_layout():
            for pc in plist:
                local = param.detach()[pc.local_start:pc.local_start + pc.numel]
                values_ok &= torch.equal(local, full[pc.name].reshape(-1)[pc.offset:pc.offset + pc.numel])
                values_ok &= tuple(full[pc.name].shape) == tuple(pc.full_shape)
                pieces.append((pc.name, pc.offset, pc.numel))
        # load_full_state_dict puts every value back where full_state_dict found it.
        shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
        shardlab.load_full_state_dict(model, shifted)
        reloaded = shardlab.full_state_dict(model)
        values_ok &= all(torch.equal(reloaded[k], shifted[k]) for k in full)
        out[case] = (pieces, values_ok)
    return out


# -- what each world size runs ------------------------------------------------------------------
def _plan(world: int) -> list[tuple[str, str, str, dict]]:
    """(kind, case, optimizer, options). kind: parity (train_engine) or custom (train_custom);
    f32: parity in float32; bf16: mixed precision on a float32 model."""
    plan = [("parity", c, o, {}) for c in (*CASES, "frozen") for o in OPTIMIZERS]
    plan += [("parity", c, "sgd", {"reshard_after_forward": False}) for c in (*CASES, "frozen")]
    plan += [("f32", "gpt", "adamw", {}), ("f32", "mlp", "sgd", {})]
    plan += [("parity", "gpt_frozen", "adamw", {}), ("accumulate", "frozen", "adamw", {})]
    if world == 2:
        plan += [("parity", c, "adamw", {"reshard_after_forward": False}) for c in CASES]
        plan += [("parity", c, o, {"prefetch": False}) for c in CASES for o in OPTIMIZERS]
        plan += [("parity", c, "adamw", {"activation_checkpointing": True}) for c in CASES]
        plan += [("parity", "gpt", "sgd", {"activation_checkpointing": True, "reshard_after_forward": False})]
        plan += [("parity", c, "sgd", {"meta": False}) for c in CASES]  # a model built with real storage
        plan += [("accumulate", c, o, {}) for c in ("gpt", "mlp") for o in OPTIMIZERS]
        plan += [("custom", "gpt", "adamw", {"clip": 0.05}), ("custom", "mlp", "sgd", {"clip": 0.1})]
        plan += [("custom", "frozen", "adamw", {"clip": 0.05, "evals": (1, 2)})]
        plan += [("parity", "frozen", "adamw", {"activation_checkpointing": True})]
        plan += [("parity", "frozen", "adamw", {"prefetch": False})]
        plan += [("custom", c, "adamw", {"evals": (1, 2)}) for c in CASES]
        plan += [("bf16", c, "adamw", {"mixed_precision": "bf16"}) for c in ("gpt", "mlp")]
    if world in (2, 3):
        plan += [("custom", "twice", o, {}) for o in OPTIMIZERS]
        plan += [("accumulate", "gpt", "adamw", {"prefetch": False})] if world == 3 else []
    return plan


def _run_plan(rank: int, world: int) -> dict:
    results = {}
    for i, (kind, case, opt, options) in enumerate(_plan(world)):
        if kind == "parity":
            results[i] = train_engine(rank, world, case, "fsdp", opt, **options)
        elif kind in ("f32", "bf16"):
            results[i] = train_engine(rank, world, case, "fsdp", opt, dtype=torch.float32, **options)
        elif kind == "accumulate":
            micro = 2 if (GLOBAL_BATCH // world) % 2 == 0 else 3  # micro batches that divide the slice
            results[i] = train_engine(rank, world, case, "fsdp", opt, micro_batches=micro, **options)
        else:
            results[i] = _custom(rank, world, case, opt, options)
    results["layouts"] = _layouts(rank, world)
    results["frozen_release"] = _frozen_release(rank, world)
    if world in (2, 4):
        results["memory"] = _memory_and_traffic(rank, world)
    if world == 2:
        results["resharding"] = _resharding(rank, world)
    results["minimal"] = minimal_runs(rank, world, "fsdp")
    return results


_REFERENCES: dict = {}


def _reference(kind: str, case: str, opt: str, options: dict):
    dtype = torch.float32 if kind in ("f32", "bf16") else DTYPE
    key = (kind if kind == "custom" else "parity", case, opt, tuple(sorted(options.items())), dtype)
    if key not in _REFERENCES:
        if kind == "custom":
            _REFERENCES[key] = reference_custom(case, opt, clip=options.get("clip"), evals=options.get("evals", ()),
                                                make_model=_build, make_batch=_batch)
        else:
            _REFERENCES[key] = train_reference(case, opt, dtype=dtype)
    return _REFERENCES[key]


def _check_custom(ref: dict, got: dict, label: str, clip: float | None) -> None:
    check_custom(ref, got, label, F64_ATOL, clip=clip)
    gathered = [p["gathered"] for p in got["probes"]]
    assert not any(gathered), f"{label}: storage left gathered after eval {gathered}"
    assert not any(p["armed"] for p in got["probes"]), f"{label}: backward state armed after a no-grad forward"


def _case_id(world: int, kind: str, case: str, opt: str, options: dict) -> str:
    opts = [f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in options.items()]
    return "-".join([f"N{world}", kind, case, opt, *opts])


WORLDS = (1, 2, 3, 4)
PLAN_CASES = [pytest.param(world, i, id=_case_id(world, *c)) for world in WORLDS for i, c in enumerate(_plan(world))]
assert len({p.id for p in PLAN_CASES}) == len(PLAN_CASES), "two cases of the plan share a test id"


@pytest.mark.slow
@pytest.mark.parametrize("world,index", PLAN_CASES)
def test_fsdp_matches_single(spawned, world, index):
    """One case of the plan at one world size against `single` (the process group is spawned once per
    world size for all of them: conftest.spawned)."""
    results = spawned(_run_plan, world)
    kind, case, opt, options = _plan(world)[index]
    label = _case_id(world, kind, case, opt, options)
    got = results[0][index]
    if kind == "custom":
        clip = options.get("clip")
        _check_custom(_reference(kind, case, opt, {k: v for k, v in options.items() if k in ("clip", "evals")}),
                      got, label, clip)
        for r in range(1, world):
            assert got["losses"] == results[r][index]["losses"], f"{label}: rank {r} losses differ"
            assert_parity((got["losses"], got["state"]), (results[r][index]["losses"], results[r][index]["state"]),
                          f"{label} rank {r} vs 0", rtol=0, atol=0)
        return
    ref = _reference(kind, case, opt, {})
    if kind == "bf16":
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-2, atol=1e-2,
                                   msg=lambda m: f"{label}: bf16 losses too far from fp32\n{m}")
        assert all(v.dtype == ref[1][k].dtype for k, v in got[1].items()), f"{label}: full state not fp32"
    elif kind == "f32":
        assert_parity(ref, got, label, **tolerance(opt, torch.float32))
    else:
        assert_parity(ref, got, label)
    for r in range(1, world):  # every rank reports the same losses and full parameters
        assert_parity(got, results[r][index], f"{label} rank {r} vs rank 0", rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_shard_layout_covers_every_parameter_once(spawned, world):
    """shard_layout: the pieces over all ranks cover every original parameter exactly once, and
    each piece holds the full state's values there."""
    results = spawned(_run_plan, world)
    for case in results[0]["layouts"]:
        ref_model = _build(case, "cpu")
        covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in ref_model.named_parameters()}
        for r in range(world):
            pieces, values_ok = results[r]["layouts"][case]
            assert values_ok, f"{case}: rank {r}'s pieces do not hold the full state's values"
            for name, offset, numel in pieces:
                covered[name][offset:offset + numel] += 1
        for name, counts in covered.items():
            assert bool((counts == 1).all()), f"{case}/N={world}: {name} not covered exactly once"


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 4))
def test_fsdp_model_state_bytes_and_traffic(spawned, world):
    for case, m in spawned(_run_plan, world)[0]["memory"].items():
        numel = count_parameters(_build(case.split("+")[0], "meta"))
        # 4 (param) + 4 (grad) + 8 (Adam moments) bytes per element of this rank's trainable
        # shards, 4 (param) per element of its frozen shards; shards are 1/N of the padded
        # flat buffers: 16 * numel / N plus padding when nothing is frozen.
        assert m["state_bytes"] == (4 * m["padded"] + 12 * m["trainable_padded"]) // world, (case, m)
        assert 0 <= m["padded"] - numel < world * m["groups"], (case, m, numel)
        assert m["state_bytes"] <= 16 * numel / world + 16 * (m["padded"] - numel), (case, m)
        # all-gather: forward + backward for the units, once for the root (kept gathered),
        # frozen groups included; reduce-scatter: every trainable gradient once, nothing of
        # the frozen groups. In bytes of fp32 padded buffers.
        assert m["gather"] == 4 * (2 * m["padded"] - m["root_padded"]), (case, m)
        assert m["reduce"] == 4 * m["trainable_padded"], (case, m)
        assert m["reduce_calls"] == m["trainable_groups"], (case, m)  # once per group, even with recompute
        if m["root_padded"] == 0:  # the MLP: exactly twice the parameter bytes
            assert m["gather"] == 2 * 4 * m["padded"]
        if case == "frozen":  # every unit (the root too) has one frozen and one trainable group
            assert m["groups"] == 2 * m["trainable_groups"] and m["trainable_padded"] < m["padded"], m


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_frozen_shards_and_release_in_backward(spawned, world):
    """Frozen shards: requires_grad=False and never a gradient; trainable ones got theirs. A unit
    with frozen groups is freed in backward once its inputs' gradients are in: when block 0's
    gradient arrives, blocks 1 and 2 are sharded again; block 0 itself, whose input comes from a
    frozen layer (no gradient, no signal), is held until the end of backward."""
    for r, result in enumerate(spawned(_run_plan, world)):
        fr = result["frozen_release"]
        assert fr["states"] == ["gathered", "sharded", "sharded"], (r, fr["states"])
        assert fr["after_backward"] == 0
        for name, (requires_grad, no_grad) in fr["shards"].items():
            assert requires_grad == ("frozen" not in name) and no_grad == ("frozen" in name), (name, fr["shards"])


@pytest.mark.slow
def test_fsdp_reshard_after_forward(spawned):
    results = spawned(_run_plan, 2)[0]["resharding"]
    after_fwd, full_bytes, after_bwd = results[True]
    assert after_fwd == [0] * len(after_fwd), f"units still gathered after forward: {after_fwd}"
    assert after_bwd == 0
    after_fwd, full_bytes, after_bwd = results[False]
    assert after_fwd == full_bytes, "reshard_after_forward=False should keep units gathered until backward"
    assert after_bwd == 0, "everything is freed after backward"


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_minimal_matches_single_and_fsdp(spawned, world):
    """fsdp-minimal in the same spawned workers: equal to `single` and to fsdp (tests/minimal_cases.py)."""
    results = spawned(_run_plan, world)
    full_runs = {(case, opt): results[0][i] for i, (kind, case, opt, options) in enumerate(_plan(world))
                 if kind == "parity" and not options}
    check_minimal([r["minimal"] for r in results], world, "fsdp", full_runs)
