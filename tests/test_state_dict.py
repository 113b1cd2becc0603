"""`model.state_dict()` / `load_state_dict()` on the module `parallelize` returns, and PyTorch's
DCP state-dict helpers on it (engines/state_dict.py, [Note: what model.state_dict() holds]).

One spawn per world size (2, and 3 for uneven shards) runs every engine on float64 models: gpt
(tied embedding and head, nothing divides N) for everything, `frozen` (frozen and trainable
parameters in one unit, uneven shards) for the keys and a plain load. Each engine's checks are
one test. Equality is exact: every value is a copy of what the engine holds.
- keys: `model.state_dict()` has the plain module's keys, in order; gathered (`full_tensor()`
  where a value is a DTensor) each value equals `shardlab.full_state_dict`'s;
- a plain module's state dict loads (`load_state_dict`), and so does the engine's own;
- `state_dict="full"`: full CPU tensors, which rank 0 saves with torch.save and a plain module
  loads; the default's DTensors do not load into a plain module;
- DCP: get_state_dict -> a step -> set_state_dict restores model and optimizer;
  set_model_state_dict(full_state_dict=True) of a plain module's state; get_model_state_dict
  (full_state_dict=True) gives the plain keys and values;
- dcp.save / dcp.load of model and (flattened) optimizer: at the same world size, and at 3 ranks
  from a save by 2 of them (a 2-rank subgroup), both equal to what was saved.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_map_only

import shardlab
from tests.parity import batch, build, make_optimizer, set_mode

# shardlab's own engines: a plugin another test module registers in this process (tests/toys.py's
# "toy", under pytest-xdist) is not registered in the spawned workers
STRATEGIES = tuple(name for name, entry in shardlab.STRATEGIES.items() if entry.target.startswith("shardlab."))
SHARDED = ("zero3", "fsdp", "zero3-minimal", "fsdp-minimal", "torch-fsdp")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _full(v: torch.Tensor) -> torch.Tensor:
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()


def _same(a, b) -> bool:
    """Equal keys in the same order, equal values (DTensors gathered), nested dicts too."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(_full(a), _full(b))
    return a == b


def _clone(tree):
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def _wrap(strategy: str, case: str, group=None, **kw):
    model = shardlab.parallelize(build(case, "meta"), strategy, device="cpu", group=group, **kw)
    set_mode(model, case)
    return model, make_optimizer("adamw", model.parameters())


def _step(model, opt, step: int, rank: int, world: int) -> None:
    x, y = batch("gpt", step)
    b = x.shape[0] // world
    opt.zero_grad(set_to_none=True)
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    opt.step()


def _optimizer_everywhere(model, opt, group=None) -> dict:
    """The optimizer's state, gathered and flattened, merged over the ranks (zero3's keys live on
    their owners only): what a checkpoint must give back at any world size."""
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                         flatten_optimizer_state_dict=True))
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in osd.items()},
                           group=group)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))


def _keys_and_values(strategy: str, rank: int, world: int) -> dict:
    out = {}
    for case in ("gpt", "frozen"):
        plain = build(case, "cpu").state_dict()
        model, opt = _wrap(strategy, case)
        if case == "gpt":
            _step(model, opt, 0, rank, world)
        sd = model.state_dict()
        out[f"{case}: keys"] = list(sd) == list(plain)
        out[f"{case}: values"] = _same(sd, shardlab.full_state_dict(model))
        other = {k: v + 1 if v.is_floating_point() else v for k, v in plain.items()}
        model.load_state_dict(other)
        out[f"{case}: plain load"] = _same(shardlab.full_state_dict(model), other)
        model.load_state_dict(sd)
        out[f"{case}: own load"] = _same(shardlab.full_state_dict(model), {k: _full(v) for k, v in sd.items()})
        if case == "gpt" and strategy in SHARDED:
            try:  # as FSDP2's: a plain module refuses one rank's shards
                build(case, "cpu").load_state_dict(sd)
                out["gpt: a plain module refuses the default's DTensors"] = False
            except RuntimeError as e:
                out["gpt: a plain module refuses the default's DTensors"] = "DTensor" in str(e)
    return out


def _full_values(strategy: str, rank: int, world: int) -> dict:
    model, opt = _wrap(strategy, "gpt", state_dict="full")
    _step(model, opt, 0, rank, world)
    sd = model.state_dict()
    full = shardlab.full_state_dict(model)
    buf = io.BytesIO()
    torch.save(sd, buf)  # what rank 0 writes
    buf.seek(0)
    plain = build("gpt", "cpu")
    plain.load_state_dict(torch.load(buf))
    return {"full: plain tensors": all(type(v) is torch.Tensor for v in sd.values()),
            "full: values": _same(sd, full), "full: torch.save, plain load": _same(plain.state_dict(), full)}


def _dcp_in_memory(strategy: str, rank: int, world: int) -> dict:
    model, opt = _wrap(strategy, "gpt")
    _step(model, opt, 0, rank, world)
    msd, osd = get_state_dict(model, opt)
    msd, osd = _clone(msd), _clone(osd)
    full, ostate = shardlab.full_state_dict(model), _clone(opt.state_dict())
    _step(model, opt, 1, rank, world)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    out = {"dcp: round trip, model": _same(shardlab.full_state_dict(model), full),
           "dcp: round trip, optimizer": _same(opt.state_dict()["state"], ostate["state"])
           and opt.state_dict()["param_groups"] == ostate["param_groups"]}
    plain = build("gpt", "cpu").state_dict()
    set_model_state_dict(model, dict(plain), options=StateDictOptions(full_state_dict=True))
    out["dcp: set_model_state_dict(full) of a plain module"] = _same(shardlab.full_state_dict(model), plain)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["dcp: get_model_state_dict(full)"] = _same(got, plain)
    out.update(_broadcast_from_rank0(model, {k: v + 1 if v.is_floating_point() else v for k, v in plain.items()},
                                     strategy, rank))
    return out


def _broadcast_from_rank0(model, plain: dict, strategy: str, rank: int) -> dict:
    """DCP's broadcast_from_rank0 (rank 0 alone given the state): it loads where the module lists its own
    parameters; zero3 and fsdp refuse it on the other ranks, naming the calls that work
    ([Note: broadcast_from_rank0 on an engine that replaced the parameters] in engines/state_dict.py)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:  # every rank receives every tensor before any load: the ranks stay in step either way
        set_model_state_dict(model, dict(plain) if rank == 0 else {}, options=options)
    except RuntimeError as e:
        refused = rank > 0 and "give every rank the whole state dict" in str(e)
        return {"dcp: broadcast_from_rank0 refused, naming the call": refused and strategy in SHARDED}
    if strategy in SHARDED and strategy != "torch-fsdp":
        return {"dcp: broadcast_from_rank0 refused, naming the call": rank == 0}
    return {"dcp: broadcast_from_rank0": _same(shardlab.full_state_dict(model), plain)}


def _dcp_files(strategy: str, rank: int, world: int, path: str) -> dict:
    """Save at `world` and load back; at 3 ranks also load what 2 of them saved."""
    model, opt = _wrap(strategy, "gpt")
    _step(model, opt, 0, rank, world)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    full, ostate = shardlab.full_state_dict(model), _clone(opt.state_dict())  # this rank's own
    here = os.path.join(path, f"{strategy}-N{world}")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=here)
    _step(model, opt, 1, rank, world)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt, options=FLAT)))
    dcp.load(state, checkpoint_id=here)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    out = {"dcp files: model": _same(shardlab.full_state_dict(model), full),
           "dcp files: optimizer": _same(opt.state_dict(), ostate)}
    if world == 3:
        out.update(_dcp_reshard(strategy, rank, os.path.join(path, f"{strategy}-2to3")))
    return out


def _dcp_reshard(strategy: str, rank: int, path: str) -> dict:
    pair = dist.new_group([0, 1])
    saved = [None, None]
    if rank < 2:
        model, opt = _wrap(strategy, "gpt", group=pair)
        _step(model, opt, 0, rank, 2)
        msd, osd = get_state_dict(model, opt, options=FLAT)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=pair)
        saved = [shardlab.full_state_dict(model), _optimizer_everywhere(model, opt, pair)]
    dist.broadcast_object_list(saved, src=0)
    model, opt = _wrap(strategy, "gpt")
    _step(model, opt, 1, rank, 3)  # state to overwrite
    state = dict(zip(("model", "optim"), get_state_dict(model, opt, options=FLAT)))
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    return {"dcp files 2 -> 3: model": _same(shardlab.full_state_dict(model), saved[0]),
            "dcp files 2 -> 3: optimizer": _same(_optimizer_everywhere(model, opt), saved[1])}


def _all_engines(rank: int, world: int, path: str) -> dict:
    out = {}
    for strategy in STRATEGIES:
        checks = _keys_and_values(strategy, rank, world)
        checks.update(_full_values(strategy, rank, world))
        if strategy != "single":  # one process per rank: DCP's helpers need the engines' group
            checks.update(_dcp_in_memory(strategy, rank, world))
            checks.update(_dcp_files(strategy, rank, world, path))
        out[strategy] = checks
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_keeps_the_module_names(spawned, ckpt_dir, world, strategy):
    results = spawned(_all_engines, world, path=ckpt_dir, timeout_s=900)
    for rank, res in enumerate(results):
        failed = [check for check, ok in res[strategy].items() if not ok]
        assert not failed, f"{strategy} at {world} ranks, rank {rank}: {failed}"
