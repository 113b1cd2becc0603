"""`ddp` equals single-process training on the same global batch.

One spawn per world size (1, 2, 3, 4); every case runs inside it: parity for the three
parity cases with SGD and AdamW (models start on meta), no_sync accumulation, activation
checkpointing, bf16 gradient reduction, gradient clipping, an eval forward after training,
a model with half of each block frozen, and the all-reduce traffic. Everything runs in
float64 (tests/parity.py explains why) except the bf16 cases and a few float32 ones.
`train_custom`/`reference_custom` are shared with the zero3 tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardlab
from shardlab.engines import engine_of, optimizer_state_bytes
from shardlab.testing import run_workers
from tests.engine_internals import gathered_bytes
from tests.parity import (
    CASES,
    DTYPE,
    F64_ATOL,
    F64_RTOL,
    GLOBAL_BATCH,
    assert_parity,
    batch,
    build,
    make_optimizer,
    set_mode,
    tolerance,
    train_engine,
    train_reference,
)

OPTIMIZERS = ("sgd", "adamw")
MAX_NORM = 0.05  # small enough that every step of every case is clipped


def accumulation_steps(world: int) -> int:
    """Micro batches per step that divide this rank's slice of the global batch."""
    b = GLOBAL_BATCH // world
    return 2 if b % 2 == 0 else 3


def _eval_batch(case_name: str) -> torch.Tensor:
    return batch(case_name, 99)[0]


def train_custom(rank: int, world: int, case_name: str, strategy: str, opt_name: str, steps: int = 3,
                 max_norm: float = MAX_NORM, **options) -> dict:
    """Train with gradient clipping, then run an eval forward (no backward) on the whole eval
    batch; report what the engine measured (traffic of the training steps, model-state bytes)."""
    model = shardlab.parallelize(build(case_name, "meta"), strategy, device="cpu", **options)
    engine = engine_of(model)
    set_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    b = GLOBAL_BATCH // world
    comm_before = engine.comm_stats() or {}
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(case_name, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        loss.backward()
        norms.append(shardlab.clip_grad_norm_(model, max_norm).item())
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    comm_after = engine.comm_stats() or {}
    state_bytes = engine.model_state_bytes()
    opt_bytes = optimizer_state_bytes(opt)
    model.eval()
    with torch.no_grad():
        eval_out = model(_eval_batch(case_name))
    # a second training-mode forward without backward, then eval again: nothing stale may remain
    set_mode(model, case_name)
    model(*[t[:2] for t in batch(case_name, 0)])
    info = engine_info(engine)
    model.eval()
    with torch.no_grad():
        eval_again = model(_eval_batch(case_name))
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    # frozen parameters (fine-tuning): requires_grad=False, never a gradient, not in the optimizer
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return {"losses": losses, "norms": norms, "eval": eval_out, "eval_again": eval_again,
            "state": shardlab.full_state_dict(model),
            "comm": _comm_delta(comm_before, comm_after),
            "model_state_bytes": sum(state_bytes.values()) + opt_bytes, "grad_bytes": grad_bytes,
            "engine_info": info, "frozen_with_grad": sum(p.grad is not None for p in frozen),
            "optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
            "trainable_params": sum(p.requires_grad for p in model.parameters())}


def _comm_delta(before: dict, after: dict) -> dict:
    """Traffic between two comm_stats() snapshots, kinds with no calls left out."""
    delta = {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v} for k, v in after.items()}
    return {k: v for k, v in delta.items() if v["calls"]}


def engine_info(engine) -> dict:
    info = {"gathered_bytes": gathered_bytes(engine)}
    for name in ("owned_bytes", "unit_param_bytes"):
        if hasattr(engine, name):
            info[name] = getattr(engine, name)
    return info


def reference_custom(case_name: str, opt_name: str, steps: int = 3, max_norm: float = MAX_NORM) -> dict:
    model = build(case_name, "cpu")
    set_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(case_name, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                    max_norm).item())
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_out = model(_eval_batch(case_name))
    return {"losses": losses, "norms": norms, "eval": eval_out,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def check_custom(ref: dict, got: dict, label: str, atol: float) -> None:
    assert_parity((ref["losses"], ref["state"]), (got["losses"], got["state"]), label, atol=atol)
    assert ref["norms"][0] > MAX_NORM, f"{label}: the test must actually clip"
    torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                               torch.tensor(ref["norms"], dtype=torch.float64), rtol=F64_RTOL, atol=0.0,
                               msg=lambda m: f"{label}: clip_grad_norm_ returned another norm\n{m}")
    # outputs sum many parameters: allow 10x the parameter tolerance; a stale parameter
    # (one missed update of size lr=1e-2) would be off by orders of magnitude more
    for key in ("eval", "eval_again"):
        torch.testing.assert_close(got[key], ref["eval"], rtol=F64_RTOL, atol=10 * atol,
                                   msg=lambda m, key=key: f"{label}: {key} forward differs from single's\n{m}")
    assert got["frozen_with_grad"] == 0, f"{label}: a frozen parameter got a gradient"
    assert got["optimizer_params"] == got["trainable_params"], f"{label}: the optimizer holds frozen parameters"


def check_same_on_every_rank(results: list[dict], label: str) -> None:
    for r in range(1, len(results)):
        for key, got in results[0].items():
            if isinstance(got, tuple):  # (losses, state) from train_engine
                assert_parity(got, results[r][key], f"{label}{key} rank {r} vs rank 0", rtol=0, atol=0)
            elif isinstance(got, dict) and "state" in got:
                other = results[r][key]
                assert_parity((got.get("losses", []), got["state"]), (other.get("losses", []), other["state"]),
                              f"{label}{key} rank {r} vs rank 0", rtol=0, atol=0)


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


def _ddp_cases(rank: int, world: int) -> dict:
    out: dict = {}
    for c in CASES:
        for o in OPTIMIZERS:
            out[("parity", c, o)] = train_engine(rank, world, c, "ddp", o)
        out[("accumulate", c)] = train_engine(rank, world, c, "ddp", "sgd", accumulate=accumulation_steps(world))
        out[("checkpointing", c)] = train_engine(rank, world, c, "ddp", "adamw", activation_checkpointing=True)
        # bf16 reduction of fp32 gradients: the realistic setting, compared with fp32 at 1e-2
        out[("bf16", c)] = train_engine(rank, world, c, "ddp", "adamw", mixed_precision="bf16", dtype=torch.float32)
        # tiny buckets: many async all-reduces in flight at once, launched in bucket order
        out[("small_buckets", c)] = train_engine(rank, world, c, "ddp", "sgd", bucket_size_bytes=512)
        out[("custom", c)] = train_custom(rank, world, c, "ddp", "adamw")
    for c, o in F32_CASES:
        out[("f32", c, o)] = train_engine(rank, world, c, "ddp", o, dtype=torch.float32)
    for o in OPTIMIZERS:
        out[("parity", "frozen", o)] = train_engine(rank, world, "frozen", "ddp", o)
    out[("accumulate", "frozen")] = train_engine(rank, world, "frozen", "ddp", "sgd",
                                                 accumulate=accumulation_steps(world))
    out[("parity", "gpt_frozen", "adamw")] = train_engine(rank, world, "gpt_frozen", "ddp", "adamw")
    for c in FROZEN:
        out[("custom", c)] = train_custom(rank, world, c, "ddp", "adamw")
    out["reuse"] = train_reuse(rank, world, "ddp")
    out["reuse_checkpointing"] = train_reuse(rank, world, "ddp", activation_checkpointing=True)
    return out


# float32 cases (FLOAT32_TOL in tests/parity.py gives their tolerances and measured noise)
F32_CASES = (("gpt", "adamw"), ("mlp", "sgd"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ddp_matches_single(world):
    results = run_workers(world, _ddp_cases)
    got = results[0]
    for c in CASES:
        for o in OPTIMIZERS:
            assert_parity(train_reference(c, o), got[("parity", c, o)], f"ddp/{c}/{o}/N={world}")
        assert_parity(train_reference(c, "sgd"), got[("accumulate", c)], f"ddp/{c}/no_sync/N={world}")
        assert_parity(train_reference(c, "adamw"), got[("checkpointing", c)], f"ddp/{c}/checkpointing/N={world}")
        assert_parity(train_reference(c, "sgd"), got[("small_buckets", c)], f"ddp/{c}/small buckets/N={world}")
        torch.testing.assert_close(torch.tensor(got[("bf16", c)][0]),
                                   torch.tensor(train_reference(c, "adamw", dtype=torch.float32)[0]),
                                   rtol=0, atol=1e-2, msg=lambda m, c=c: f"ddp/{c}/bf16 losses drift\n{m}")
    for c, o in F32_CASES:
        assert_parity(train_reference(c, o, dtype=torch.float32), got[("f32", c, o)], f"ddp/{c}/{o}/fp32/N={world}",
                      **tolerance(o, torch.float32))
    for o in OPTIMIZERS:
        assert_parity(train_reference("frozen", o), got[("parity", "frozen", o)], f"ddp/frozen/{o}/N={world}")
    assert_parity(train_reference("frozen", "sgd"), got[("accumulate", "frozen")], f"ddp/frozen/no_sync/N={world}")
    assert_parity(train_reference("gpt_frozen", "adamw"), got[("parity", "gpt_frozen", "adamw")],
                  f"ddp/gpt_frozen/adamw/N={world}")
    for c in (*CASES, *FROZEN):
        custom = got[("custom", c)]
        check_custom(reference_custom(c, "adamw"), custom, f"ddp/{c}/clip+eval/N={world}", F64_ATOL)
        # the all-reduce payload is exactly the trainable gradients, once per step: frozen
        # parameters' gradients are neither computed nor sent
        all_reduce = custom["comm"].get("all_reduce", {})
        assert custom["grad_bytes"] == trainable_bytes(c), (c, custom["grad_bytes"])
        assert all_reduce.get("payload_bytes") == 3 * trainable_bytes(c), (c, custom["comm"])
        assert set(custom["comm"]) == {"all_reduce"}, custom["comm"]
    reuse_ref = train_reuse(0, 1, None)
    for key in ("reuse", "reuse_checkpointing"):
        assert_parity(reuse_ref, got[key], f"ddp/{key}/N={world}")
    check_same_on_every_rank(results, f"ddp/N={world}/")
