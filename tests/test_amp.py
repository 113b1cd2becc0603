"""fp16 loss scaling (shardlab.loop.amp): gradients that underflow in fp16 survive with the scaler
and vanish without it; an overflow seen by one rank skips the step on every rank alike, also
when another rank holds no trainable gradient at all (zero3, a rank owning only frozen weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardlab
from shardlab.loop.loss import autocast, make_loss_scaler
from shardlab.testing import run_workers

TINY = 1e-7  # loss factor: gradients ~1e-8, below fp16's smallest subnormal (6e-8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _one_trainable_model() -> nn.Module:
    """Only the last weight trains: at N=2 zero3 gives it to rank 0, and rank 1 owns only
    frozen weights (it has no gradient, yet must join the scaler's found-inf all-reduce)."""
    model = _model()
    for name, p in model.named_parameters():
        p.requires_grad_(name == "2.weight")
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x).float() ** 2).mean() * TINY


def _grads(scaled: bool) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    scaler = make_loss_scaler(scaled, torch.device("cpu"), False, init_scale=2.0**16, growth_interval=2000)
    with autocast("fp16", torch.device("cpu")):
        loss = _loss(model, x)
    (scaler.scale(loss) if scaled else loss).backward()
    if scaled:
        scaler.unscale_(opt)
    return [p.grad.clone() for p in model.parameters()]


def test_fp16_gradients_underflow_without_scaler_and_survive_with_it():
    model = _model()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    _loss(model, x).backward()
    reference = [p.grad for p in model.parameters()]  # fp32
    weights = [0, 2]  # the Linear weights (biases' gradients are sums, less prone to underflow)
    plain = _grads(scaled=False)
    scaled = _grads(scaled=True)
    for i in weights:
        assert reference[i].abs().max() > 0
        assert plain[i].abs().max() == 0, "fp16 without scaling should flush these gradients to zero"
        # fp16 compute (11-bit mantissa, some products near the subnormal range even when
        # scaled): measured norm-wise relative error ~3e-3 here; 5e-2 leaves room for other
        # CPUs, and an unscaled or doubly scaled gradient (off by 2**16) is far outside it.
        error = (scaled[i] - reference[i]).norm() / reference[i].norm()
        assert error < 5e-2, f"scaled fp16 gradient off by {error:.2e} (norm-wise, relative)"


def _overflow_on_one_rank(rank: int, world: int, strategy: str, one_trainable: bool = False) -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = shardlab.parallelize(_one_trainable_model() if one_trainable else _model(), strategy, device="cpu")
    holds_gradients = any(p.requires_grad for p in model.parameters())
    overflow_rank = 0 if one_trainable else world - 1  # the rank whose gradient overflows
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_loss_scaler(True, torch.device("cpu"), True, init_scale=1024.0, growth_interval=1)
    before = {k: v.clone() for k, v in shardlab.full_state_dict(model).items()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    outcomes = []
    for step in range(2):
        with autocast("fp16", torch.device("cpu")):
            loss = (model(x).float() ** 2).mean()
        scaler.scale(loss).backward()
        if step == 0 and rank == overflow_rank:  # an overflow in this rank's gradient only
            local = [g.to_local() if hasattr(g, "to_local") else g  # torch-fsdp: a DTensor's own shard
                     for g in (p.grad for p in model.parameters() if p.grad is not None)]
            next(g for g in local if g.numel()).view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        outcomes.append((scale, scaler.get_scale()))
        if step == 0:
            unchanged = all(torch.equal(v, before[k]) for k, v in shardlab.full_state_dict(model).items())
    after = shardlab.full_state_dict(model)
    moved = any(not torch.equal(v, before[k]) for k, v in after.items())
    return {"outcomes": outcomes, "unchanged_after_overflow": unchanged, "moved_after_good_step": moved,
            "holds_gradients": holds_gradients, "warned": [str(w.message) for w in said]}


@pytest.mark.slow
def test_overflow_on_one_rank_skips_the_step_everywhere():
    results = run_workers(2, _run_all, timeout_s=600)   # a hang guard only, not a speed budget
    frozen_only = [r["zero3, one rank owning only frozen weights"] for r in results]
    assert [r["holds_gradients"] for r in frozen_only] == [True, False], frozen_only
    assert any("rank(s) [1] own only frozen parameters" in w for w in frozen_only[1]["warned"]), frozen_only
    for strategy in ("ddp", "zero3", "fsdp", "torch-fsdp", "zero3, one rank owning only frozen weights"):
        per_rank = [{k: v for k, v in r[strategy].items() if k not in ("holds_gradients", "warned")} for r in results]
        assert per_rank[0] == per_rank[1], f"{strategy}: ranks disagree {per_rank}"
        r = per_rank[0]
        assert r["outcomes"][0] == (1024.0, 512.0), f"{strategy}: overflow must halve the scale: {r}"
        assert r["outcomes"][1] == (512.0, 1024.0), f"{strategy}: a good step grows it (interval 1): {r}"
        assert r["unchanged_after_overflow"] and r["moved_after_good_step"], f"{strategy}: {r}"


def _run_all(rank: int, world: int) -> dict:
    out = {s: _overflow_on_one_rank(rank, world, s) for s in ("ddp", "zero3", "fsdp", "torch-fsdp")}
    out["zero3, one rank owning only frozen weights"] = _overflow_on_one_rank(rank, world, "zero3", one_trainable=True)
    return out
