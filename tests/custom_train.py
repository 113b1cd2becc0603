"""Training with the extras parity.train_engine leaves out, shared by the engines' parity files:
global-norm clipping, no-grad forwards between steps and after training, and what the engine
measured (traffic, model-state bytes, gradients of frozen parameters). `train_custom` runs an
engine on N ranks, `reference_custom` the same in one process without any engine, and
`check_custom` compares them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import shardlab
from shardlab.engines import engine_of, optimizer_state_bytes
from tests.engine_internals import gathered_bytes
from tests.parity import (
    ALL_CASES,
    F64_RTOL,
    GLOBAL_BATCH,
    assert_parity,
    batch,
    build,
    make_optimizer,
    set_mode,
)

MAX_NORM = 0.05  # small enough that every step of every case is clipped


def _train_mode(model: torch.nn.Module, case_name: str) -> None:
    if case_name in ALL_CASES:
        set_mode(model, case_name)
    else:
        model.train()


def _final_evals(model: torch.nn.Module, case_name: str, make_batch: Callable, engine=None) -> tuple:
    """An eval-mode forward on the eval batch; then a training-mode forward without backward (the
    engine's state after it: engine_info) and the eval forward again: nothing stale may remain."""
    eval_batch = make_batch(case_name, 99)[0]
    model.eval()
    with torch.no_grad():
        first = model(eval_batch)
    _train_mode(model, case_name)
    model(*[t[:2] for t in make_batch(case_name, 0)])
    info = engine_info(engine) if engine is not None else None
    model.eval()
    with torch.no_grad():
        again = model(eval_batch)
    return first, again, info


def train_custom(rank: int, world: int, case_name: str, strategy: str, opt_name: str, steps: int = 3,
                 clip: float | None = MAX_NORM, evals: tuple[int, ...] = (), probe: Callable | None = None,
                 make_model: Callable = build, make_batch: Callable = batch, **options) -> dict[str, Any]:
    """Each rank trains on its slice of the global batch with clipping to `clip` (None: none); after
    each step in `evals`, a no-grad forward on the whole eval batch in training mode, and
    `probe(engine)` (what the engine holds then) recorded; after training, `_final_evals`. Reports
    the global mean loss per step, the norms, the eval outputs, the full state, the traffic of the
    training steps, model-state bytes, and whether frozen parameters stayed out of it all."""
    model = shardlab.parallelize(make_model(case_name, "meta"), strategy, device="cpu", **options)
    engine = engine_of(model)
    _train_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    b = GLOBAL_BATCH // world
    comm_before = engine.comm_stats() or {}
    out: dict[str, Any] = {"losses": [], "norms": [], "evals": [], "probes": []}
    for step in range(steps):
        x, y = make_batch(case_name, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        loss.backward()
        if clip is not None:
            out["norms"].append(shardlab.clip_grad_norm_(model, clip).item())
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        out["losses"].append(t.item() / world)
        if step in evals:
            with torch.no_grad():
                out["evals"].append(model(make_batch(case_name, 99)[0]))
            out["probes"].append(probe(engine) if probe else None)
    comm_after = engine.comm_stats() or {}
    state_bytes = sum(engine.model_state_bytes().values()) + optimizer_state_bytes(opt)
    out["eval"], out["eval_again"], out["engine_info"] = _final_evals(model, case_name, make_batch, engine)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return {**out, "state": shardlab.full_state_dict(model), "comm": comm_delta(comm_before, comm_after),
            "model_state_bytes": state_bytes,
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
            "frozen_with_grad": sum(p.grad is not None for p in frozen),
            "optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
            "trainable_params": sum(p.requires_grad for p in model.parameters())}


def reference_custom(case_name: str, opt_name: str, steps: int = 3, clip: float | None = MAX_NORM,
                     evals: tuple[int, ...] = (), make_model: Callable = build, make_batch: Callable = batch) -> dict:
    """train_custom's run in one process, on the whole global batch, without any engine."""
    model = make_model(case_name, "cpu")
    _train_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    out: dict[str, Any] = {"losses": [], "norms": [], "evals": []}
    for step in range(steps):
        x, y = make_batch(case_name, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                               clip).item())
        opt.step()
        out["losses"].append(loss.item())
        if step in evals:
            with torch.no_grad():
                out["evals"].append(model(make_batch(case_name, 99)[0]))
    out["eval"], out["eval_again"], _ = _final_evals(model, case_name, make_batch)
    return {**out, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def check_custom(ref: dict, got: dict, label: str, atol: float, clip: float | None = MAX_NORM) -> None:
    assert_parity((ref["losses"], ref["state"]), (got["losses"], got["state"]), label, atol=atol)
    if clip is not None:
        assert ref["norms"][0] > clip, f"{label}: the test must actually clip"
    torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                               torch.tensor(ref["norms"], dtype=torch.float64), rtol=F64_RTOL, atol=0.0,
                               msg=lambda m: f"{label}: clip_grad_norm_ returned another norm\n{m}")
    # outputs sum many parameters: allow 10x the parameter tolerance; a stale parameter
    # (one missed update of size lr=1e-2) would be off by orders of magnitude more
    assert len(got["evals"]) == len(ref["evals"]), label
    outputs = [*zip(got["evals"], ref["evals"]), (got["eval"], ref["eval"]), (got["eval_again"], ref["eval"])]
    for i, (a, b) in enumerate(outputs):
        torch.testing.assert_close(a, b, rtol=F64_RTOL, atol=10 * atol,
                                   msg=lambda m, i=i: f"{label}: eval forward {i} differs from single's\n{m}")
    assert got["frozen_with_grad"] == 0, f"{label}: a frozen parameter got a gradient"
    assert got["optimizer_params"] == got["trainable_params"], f"{label}: the optimizer holds frozen parameters"


def comm_delta(before: dict, after: dict) -> dict:
    """Traffic between two comm_stats() snapshots, kinds with no calls left out."""
    delta = {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v} for k, v in after.items()}
    return {k: v for k, v in delta.items() if v["calls"]}


def engine_info(engine) -> dict:
    info = {}
    for name in ("owned_bytes", "unit_param_bytes"):
        if hasattr(engine, name):
            info[name] = getattr(engine, name)
    if engine.grads_sharded:
        info["gathered_bytes"] = gathered_bytes(engine)
    return info
