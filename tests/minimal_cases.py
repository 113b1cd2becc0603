"""The minimal engines (engines/*_minimal.py) proven inside the full engines' workers: each
test_engine_{ddp,zero3,fsdp}.py spawns once per world size (1..4) and its worker adds
`minimal_runs` for its minimal twin, so they cost no process start of their own.

Per world size and engine: parity with `single` in float64 on every parity case (gpt, mlp,
resnet, both frozen ones: uneven shards at N = 2, 3, 4) with SGD or AdamW, and no_sync
accumulation; at N = 2 and 3 clipping, at N = 2 activation checkpointing too (the minimal
engines' cases are a few: the suite's time is spent on the full engines). Then equality with the full engine on the
same runs (its results come from the same worker), every rank alike, the shard layout
covering each parameter once with the full state's values, a full state dict loading back,
and the bytes and calls counted in one step equal to what the engine tells plan
(`step_traffic`).
"""

from __future__ import annotations

import functools
import math

import torch

import shardlab
from shardlab.engines import engine_class, engine_of
from shardlab.engines.planning import ModelTraffic
from shardlab.models import repeated_blocks
from tests.parity import GLOBAL_BATCH, assert_parity, batch, build, set_mode, train_engine, train_reference

MINIMAL = {"ddp": "ddp-minimal", "zero3": "zero3-minimal", "fsdp": "fsdp-minimal"}
#: (case, optimizer) trained at every world size; the full engines' workers run the same ones
PARITY = (("gpt", "sgd"), ("mlp", "adamw"), ("resnet", "sgd"), ("frozen", "adamw"), ("gpt_frozen", "adamw"))
CLIP = 0.05  # small enough that every step clips: a wrong global norm changes the update


@functools.cache
def _reference(case: str, opt: str, clip: float | None) -> tuple[list[float], dict]:
    """`single`'s run, once per test process (the world sizes' tests share it)."""
    return train_reference(case, opt, clip=clip)


def _micro_batches(world: int) -> int:
    return 2 if (GLOBAL_BATCH // world) % 2 == 0 else 3


def minimal_runs(rank: int, world: int, full: str) -> dict:
    """Everything a worker of `full`'s test runs for its minimal twin."""
    s = MINIMAL[full]
    out: dict = {("parity", c, o): train_engine(rank, world, c, s, o) for c, o in PARITY}
    accumulate = [("frozen", "sgd"), *([("gpt", "adamw")] if world == 2 else [])]
    for c, o in accumulate:
        out[("accumulate", c, o)] = train_engine(rank, world, c, s, o, micro_batches=_micro_batches(world))
    if world in (2, 3):
        out[("clip", "gpt_frozen", "sgd")] = train_engine(rank, world, "gpt_frozen", s, "sgd", clip=CLIP)
    if world == 2:
        out[("checkpointing", "gpt", "adamw")] = train_engine(rank, world, "gpt", s, "adamw",
                                                              activation_checkpointing=True)
    out["layout"] = {c: _layout(s, c) for c in ("gpt", "frozen")}
    out["traffic"] = _one_step_traffic(rank, world, s, "gpt")
    return out


def _layout(strategy: str, case: str) -> dict:
    """This rank's pieces (name, offset, numel), whether each holds the full state's values there,
    and whether a changed full state dict loads back exactly."""
    model = shardlab.parallelize(build(case, "meta"), strategy, device="cpu")
    full = shardlab.full_state_dict(model)
    pieces, holds = [], True
    for param, plist in engine_of(model).shard_layout():
        for pc in plist:
            mine = param.detach().reshape(-1)[pc.local_start:pc.local_start + pc.numel]
            holds &= torch.equal(mine, full[pc.name].reshape(-1)[pc.offset:pc.offset + pc.numel])
            pieces.append((pc.name, pc.offset, pc.numel))
    changed = {k: v * 2 + 1 if v.is_floating_point() else v for k, v in full.items()}
    shardlab.load_full_state_dict(model, changed)
    back = shardlab.full_state_dict(model)
    return {"pieces": pieces, "holds": holds, "loads_back": all(torch.equal(back[k], changed[k]) for k in full)}


def _one_step_traffic(rank: int, world: int, strategy: str, case: str) -> dict:
    """What one training step sent, by kind (calls, payload bytes)."""
    model = shardlab.parallelize(build(case, "meta"), strategy, device="cpu")
    set_mode(model, case)
    engine = engine_of(model)
    before = engine.comm_stats()
    x, y = batch(case, 0)
    b = GLOBAL_BATCH // world
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    after = engine.comm_stats()
    return {k: (v["calls"] - before.get(k, {}).get("calls", 0), v["payload_bytes"] - before.get(k, {}).get(
        "payload_bytes", 0)) for k, v in after.items() if v["calls"] > before.get(k, {}).get("calls", 0)}


def _planned_traffic(strategy: str, case: str, world: int) -> dict:
    """The engine's own `step_traffic` for the case's model: kind -> (calls, payload bytes)."""
    model = build(case, "meta")
    params = list({id(p): p for p in model.parameters()}.values())
    in_units = {id(p) for u in repeated_blocks(model) for p in u.parameters()}
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    trainable = [p for p in params if p.requires_grad]
    traffic = ModelTraffic(nbytes(params), nbytes(trainable), nbytes(p for p in params if id(p) not in in_units),
                           len(repeated_blocks(model)), 1, world, len(params), len(trainable))
    out: dict = {}
    for c in engine_class(strategy).step_traffic(traffic, {}):
        calls, payload = out.get(c.kind, (0, 0))
        out[c.kind] = (calls + c.calls, payload + c.calls * c.nbytes)
    return out


def check_minimal(results: list[dict], world: int, full: str, full_runs: dict) -> None:
    """`results`: each rank's `minimal_runs` output, rank by rank; `full_runs`: (case, optimizer) ->
    the full engine's (losses, state) of the same parity run, rank 0's."""
    s = MINIMAL[full]
    got = results[0]
    for key, run in got.items():
        if key in ("layout", "traffic"):
            continue
        kind, case, opt = key
        ref = _reference(case, opt, CLIP if kind == "clip" else None)
        assert_parity(ref, run, f"{s}/{kind}/{case}/{opt}/N={world}")
        for r in range(1, world):
            assert_parity(run, results[r][key], f"{s}/{key}/N={world} rank {r} vs 0", rtol=0, atol=0)
    for case, opt in PARITY:
        assert_parity(full_runs[(case, opt)], got[("parity", case, opt)], f"{s} vs {full}/{case}/{opt}/N={world}")
    copies = 1 if engine_class(s).grads_sharded else world  # a replicated engine: every rank holds everything
    for case in got["layout"]:
        covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in build(case, "meta").named_parameters()}
        for r in range(world):
            mine = results[r]["layout"][case]
            assert mine["holds"] and mine["loads_back"], f"{s}/{case}/N={world}: rank {r}'s layout {mine}"
            for name, offset, numel in mine["pieces"]:
                covered[name][offset:offset + numel] += 1
        for name, counts in covered.items():
            assert bool((counts == copies).all()), f"{s}/{case}/N={world}: {name} not held {copies} time(s)"
    _check_traffic(s, world, [r["traffic"] for r in results])


def _check_traffic(strategy: str, world: int, counted: list[dict]) -> None:
    """Counted = planned, exactly, except fsdp-minimal's padding: its gathers and reduce-scatters
    move padded flat buffers, fewer than N elements more per group and call."""
    planned = _planned_traffic(strategy, "gpt", world)
    assert all(c == counted[0] for c in counted), counted
    if world == 1:
        planned = {k: v for k, v in planned.items() if k in counted[0]}  # one rank counts what sends nothing too
    assert set(counted[0]) == set(planned), (strategy, counted[0], planned)
    for kind, (calls, payload) in counted[0].items():
        assert calls == planned[kind][0], (strategy, kind, calls, planned)
        slack = 8 * world * calls if strategy == "fsdp-minimal" else 0  # float64: 8 bytes per padded element
        assert 0 <= payload - planned[kind][1] <= slack and math.isfinite(payload), (strategy, kind, payload, planned)
