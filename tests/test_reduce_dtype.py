"""parallel.reduce_dtype: the dtype gradients are reduced in, apart from the compute dtype.

torchtitan's FSDP2 default computes in bf16 and reduces in fp32 (its `mixed_precision_reduce`);
shardlab's `parallel.mixed_precision=bf16` reduces in bf16 unless `parallel.reduce_dtype=fp32`.
- config: the pair becomes the engines' MixedPrecision; an engine that takes none refuses either key;
- one 2-rank spawn, every engine that takes a mixed-precision policy:
  - the gradient collectives carry 4 bytes per element with reduce fp32, 2 with bf16, while the
    all-gathers stay in the compute dtype (the counters, and plan's traffic model beside them);
  - on a float64 model, reducing in fp32 rounds the gradients to fp32 and no more: one SGD step
    differs from the float64 reduction by more than nothing and less than fp32's rounding.
"""

from __future__ import annotations

import pytest
import torch

import shardlab
from shardlab.config import ConfigError, engine_options, load_config
from shardlab.engines.api import MixedPrecision
from shardlab.plan.traffic import comm_plan
from shardlab.testing import run_workers
from tests.parity import batch, build, train_engine

ENGINES = ("ddp", "zero3", "fsdp", "torch-fsdp")
REDUCE_KIND = {"ddp": "all_reduce", "zero3": "reduce", "fsdp": "reduce_scatter", "torch-fsdp": "reduce_scatter"}
GATHER_KIND = {"zero3": "broadcast", "fsdp": "all_gather", "torch-fsdp": "all_gather"}


def _cfg(*overrides: str):
    return load_config("configs/gpt-tiny.yaml", ["data.source=synthetic", *overrides])


def test_config_pairs_become_the_engines_policy():
    assert MixedPrecision.from_names("fp32", None) is None
    assert MixedPrecision.from_names("bf16", None) == MixedPrecision(torch.bfloat16, torch.bfloat16)
    assert MixedPrecision.from_names("bf16", "fp32") == MixedPrecision(torch.bfloat16, torch.float32)
    assert MixedPrecision.from_names("fp32", "bf16") == MixedPrecision(None, torch.bfloat16)
    assert MixedPrecision.from_names("bf16", "bf16") == MixedPrecision(torch.bfloat16, torch.bfloat16)
    opts = engine_options(_cfg("parallel.mixed_precision=bf16", "parallel.reduce_dtype=fp32").parallel)
    assert opts["mixed_precision"] == MixedPrecision(torch.bfloat16, torch.float32)
    with pytest.raises(ConfigError, match=r"parallel.reduce_dtype=fp32 .* parallel.strategy=torch-ddp does not take"):
        _cfg("parallel.strategy=torch-ddp", "parallel.reduce_dtype=fp32")
    with pytest.raises(ConfigError, match="parallel.reduce_dtype"):
        _cfg("parallel.reduce_dtype=fp8")
    # an engine without a mixed-precision policy would run in the parameters' dtype: refused, not ignored
    for strategy in ("torch-ddp", "single", "fsdp-minimal"):
        for mp in ("bf16", "fp16", "fp64"):
            with pytest.raises(ConfigError, match=rf"parallel.mixed_precision={mp} .* parallel.strategy={strategy} does not take"):
                _cfg(f"parallel.strategy={strategy}", f"parallel.mixed_precision={mp}")
        _cfg(f"parallel.strategy={strategy}", "parallel.mixed_precision=fp32")


def test_plan_traffic_counts_gradients_in_the_reduce_dtype():
    def traffic(engine: str, *overrides: str) -> dict[str, float]:
        cfg = _cfg("train.global_batch_size=16", *overrides)
        return {kind: b * calls for kind, b, calls, _ in comm_plan(cfg, engine, 2)}

    for engine, reduce in (("fsdp", "reduce_scatter"), ("zero3", "reduce"), ("torch-fsdp", "reduce_scatter"),
                           ("ddp", "all_reduce")):
        low = traffic(engine, "parallel.mixed_precision=bf16")
        high = traffic(engine, "parallel.mixed_precision=bf16", "parallel.reduce_dtype=fp32")
        assert high[reduce] == 2 * low[reduce], engine
        gather = {"zero3": "broadcast"}.get(engine, "all_gather")
        assert high.get(gather) == low.get(gather), engine
    # torch-ddp takes no policy: its buckets are the parameters' fp32 whatever mixed_precision says
    assert traffic("torch-ddp", "parallel.mixed_precision=bf16") == traffic("torch-ddp")


def _one_backward_bytes(strategy: str, mp: MixedPrecision | None, rank: int, world: int) -> dict[str, int]:
    model = shardlab.parallelize(build("gpt", "meta", torch.float32), strategy, device="cpu", mixed_precision=mp)
    engine = shardlab.engine_of(model)
    before = engine.comm_stats()
    x, y = batch("gpt", 0, torch.float32)
    b = len(x) // world
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    after = engine.comm_stats()
    return {k: after[k]["payload_bytes"] - before.get(k, {}).get("payload_bytes", 0) for k in after}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for strategy in ENGINES:
        for name, mp in (("bf16", MixedPrecision.from_names("bf16", None)),
                         ("bf16+fp32", MixedPrecision.from_names("bf16", "fp32"))):
            out[(strategy, name, "bytes")] = _one_backward_bytes(strategy, mp, rank, world)
        for name, mp in (("fp64", None), ("fp64+fp32", MixedPrecision(None, torch.float32))):
            out[(strategy, name, "sgd")] = train_engine(rank, world, "gpt", strategy, "sgd", steps=1,
                                                        mixed_precision=mp)
    return out


@pytest.mark.slow
def test_every_engine_reduces_in_reduce_dtype():
    results = run_workers(2, _worker, timeout_s=240)[0]
    for strategy in ENGINES:
        low, high = results[(strategy, "bf16", "bytes")], results[(strategy, "bf16+fp32", "bytes")]
        kind = REDUCE_KIND[strategy]
        assert high[kind] == 2 * low[kind] > 0, (strategy, low, high)
        if strategy in GATHER_KIND:  # the parameters are still gathered in bf16
            assert high[GATHER_KIND[strategy]] == low[GATHER_KIND[strategy]], (strategy, low, high)
        # one SGD step (lr 0.5) on a float64 model: the fp32 reduction rounds each gradient element
        # to fp32 (relative 2**-24 each, then summed over two ranks), visible and no larger
        (_, exact), (_, rounded) = results[(strategy, "fp64", "sgd")], results[(strategy, "fp64+fp32", "sgd")]
        worst = max((rounded[k] - v).abs().max().item() for k, v in exact.items())
        largest = max(v.abs().max().item() for v in exact.values())
        assert 0 < worst < 1e-5 * max(largest, 1.0), (strategy, worst, largest)
