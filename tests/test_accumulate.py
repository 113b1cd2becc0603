"""`accumulate="sharded"` ([Note: sharded accumulation] in engines/api.py) on the engines with a
gradient shard: every micro batch's gradient reduced into the shard equals the local
accumulation (the unsharded sum reduced once) in float64, plain SGD, at k = 1 and k = 3, and
against `single`; it holds no unsharded gradient between micro batches and sends k times the
local mode's reduce bytes (counted, so exact). One spawn at N = 2 runs every case (tests/plans.py)."""

import pytest
import torch

import shardlab
from shardlab.engines.api import engine_of
from shardlab.engines.measuring import nbytes
from tests.parity import FLOAT32_TOL, GLOBAL_BATCH, assert_parity, batch, build, set_mode, train_engine
from tests.plans import case_id, check_against_single, plan_params, run_plan

ENGINES = ("zero3", "fsdp", "torch-fsdp")
REDUCE = {"zero3": "reduce", "fsdp": "reduce_scatter", "torch-fsdp": "reduce_scatter"}
K = 3  # micro batches per rank: the N = 2 slice of 6 rows in 3


def _plan(world: int) -> dict:
    """(engine, k, mode[, variant]) -> a gpt SGD run; the variants take the other ways a reduced
    gradient reaches the shard: through the host (offload), a replica all-reduce (HSDP: shard
    groups of one rank), a reduce dtype below the parameters'."""
    plan = {(s, k, mode): (train_engine, ("gpt", s, "sgd"), {"micro_batches": k, "accumulate": mode})
            for s in ENGINES for k in (1, K) for mode in ("local", "sharded")}
    variants = {"offload": {"offload": "cpu"}, "hsdp": {"shard_size": 1},
                "reduce_fp32": {"mixed_precision": {"reduce_dtype": torch.float32}}}
    for s in ENGINES:
        for name, options in variants.items():
            if name == "hsdp" and s == "zero3":
                continue  # zero3 has no hybrid sharding
            plan[(s, K, "sharded", name)] = (train_engine, ("gpt", s, "sgd"),
                                             {"micro_batches": K, "accumulate": "sharded", **options})
    plan[("held",)] = (_held_and_sent, (), {})
    return plan


def _held_and_sent(rank: int, world: int) -> dict:
    """One step of k micro batches per engine and mode: the unsharded gradient bytes the engine
    holds after each micro batch's backward, and the bytes its gradient reductions carried."""
    out = {}
    b = GLOBAL_BATCH // world
    x, y = (t[rank * b:(rank + 1) * b] for t in batch("gpt", 0))
    mb = b // K
    for s in ENGINES:
        for mode in ("local", "sharded"):
            model = shardlab.parallelize(build("gpt", "meta"), s, device="cpu", accumulate=mode)
            set_mode(model, "gpt")
            engine = engine_of(model)
            sent_before = (engine.comm_stats() or {}).get(REDUCE[s], {}).get("payload_bytes", 0)
            held = []
            for i in range(K):
                with shardlab.no_sync(model) if i < K - 1 else torch.enable_grad():
                    (model(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / K).backward()
                held.append(sum(nbytes(t) for part, t in engine.memory_buffers() if part == "unsharded_grads"))
            sent = engine.comm_stats()[REDUCE[s]]["payload_bytes"] - sent_before
            out[(s, mode)] = {"held": held, "sent": sent,
                              "grad_bytes": sum(nbytes(p) for p in build("gpt", "meta").parameters())}
    return out


RUNS = [p for p in plan_params(_plan, (2,)) if p.values[1] != ("held",)]


@pytest.mark.slow
@pytest.mark.parametrize("world,key", RUNS)
def test_sharded_accumulation_equals_local(spawned, world, key):
    """Each run against `single`; a sharded run also against its engine's local run (float64 at the
    parity tolerance; reducing in fp32 at float32's SGD tolerance: an overwritten micro batch would
    leave a third of the gradient, far outside it)."""
    results = spawned(run_plan, world, plan=_plan)[0]
    label = case_id(world, key)
    plan = _plan(world)
    if key[-1] == "reduce_fp32":
        local = results[(key[0], K, "local")]
        assert_parity(local, results[key], f"{label} vs local", **FLOAT32_TOL["sgd"])
        return
    check_against_single(plan[key], results[key], label)
    if key[2] == "sharded":
        assert_parity(results[(key[0], key[1], "local")], results[key], f"{label} vs local")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ENGINES)
def test_sharded_accumulation_holds_no_unsharded_gradient(spawned, strategy):
    """Local: the whole unsharded gradient (every parameter's bytes) held after each no_sync
    backward; sharded: nothing after any. Sharded sends exactly k times local's reduce bytes."""
    got = spawned(run_plan, 2, plan=_plan)[0][("held",)]
    local, sharded = got[(strategy, "local")], got[(strategy, "sharded")]
    assert all(h >= local["grad_bytes"] for h in local["held"][:-1]), local
    assert sharded["held"] == [0] * K, sharded
    assert local["sent"] > 0 and sharded["sent"] == K * local["sent"], (local, sharded)
