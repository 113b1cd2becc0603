"""The runs `shardlab verify` compares, and what each records.

Every run goes through `run.build_run` and `train.train_step`, the code `shardlab train`
runs; verify only chooses the config, the order of the samples and what to read:

  reference  one process (`--against single`) whose micro batch i is the N ranks' micro
             batches i together, in rank order; or the config under ddp at N (`--against ddp`)
  noise      the reference again with the rows of every micro batch reversed: the same maths
             in another summation order, so its distance from the reference is the rounding
             noise of this model, dtype and optimizer (the noise floor the report prints)
  engine     the config itself at N ranks

With `--against single`, rank 0 runs the reference and rank 1 the noise run at the same time
(both on a one-process Runtime, no collective), the other ranks wait; then all run the engine.
Each run writes, under the work directory, per step: the loss, the gradient norm, the full
state dict after the optimizer step (rank 0) and each rank's gradient pieces before clipping
(by original name, from `Engine.shard_layout()`, so sharded and replicated engines, DTensors
and HSDP replicas alike); for the first micro batch of step 0, a fingerprint of every module's
output per sample (`fingerprint`). compare.py reads them back.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardlab
from shardlab.config import config_from_dict
from shardlab.data import build_datasets, collate
from shardlab.data.loader import StepBatches
from shardlab.engines import ONE_PROCESS
from shardlab.loop.loss import count_targets
from shardlab.loop.run import build_run
from shardlab.loop.runtime import Runtime
from shardlab.loop.train import train_step
from shardlab.verify.float64 import Float64Everywhere

# How long the ranks not running a one-process reference wait for it (a cut 7B in float64
# on CPU takes minutes); the engine run's collectives keep parallel.timeout_s.
REFERENCE_WAIT_S = 6 * 3600


@dataclass(frozen=True)
class Plan:
    """What the workers run (picklable): the configs as dicts, the options, where to write."""

    engine: dict[str, Any]
    reference: dict[str, Any]
    nproc: int
    steps: int
    against: str                 # single | ddp
    dtype: str                   # float64 | config
    keep_dropout: bool
    workdir: str
    notes: tuple[str, ...] = ()  # what verify changed in the config, and why

    @property
    def references(self) -> tuple[str, ...]:
        """The runs besides the engine's. With dropout kept, reversing rows changes the masks, so a
        noise run would measure dropout, not rounding: it is not run."""
        return ("reference",) if self.keep_dropout else ("reference", "noise")


# -- the order of the samples ------------------------------------------------------------------------
class StepOrder:
    """A verify run's sampler: the config's `GlobalBatchSampler` (the same batches) with the rows
    placed as the comparison needs. `interleave=N`: one process takes, as its micro batch i, the
    N ranks' micro batches i in rank order. `reverse`: each micro batch's rows reversed."""

    def __init__(self, base, micro: int, interleave: int = 1, reverse: bool = False):
        self.base, self.micro, self.interleave, self.reverse = base, micro, interleave, reverse
        self.global_batch_size = base.global_batch_size

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        idx = self.base.rank_indices(step, rank, world_size)
        if self.interleave > 1:  # [N ranks, k micro, rows] -> [k micro, N ranks, rows]
            idx = idx.view(self.interleave, -1, self.micro // self.interleave).transpose(0, 1).reshape(-1)
        if self.reverse:
            idx = idx.view(-1, self.micro).flip(1).reshape(-1)
        return idx


class CastFloating(torch.utils.data.Dataset):
    """A dataset whose floating-point inputs come in `dtype` (images and vectors for a float64 run)."""

    def __init__(self, dataset, dtype: torch.dtype):
        self.dataset, self.dtype = dataset, dtype

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        x, y = self.dataset[i]
        return (x.to(self.dtype) if x.is_floating_point() else x), y


# -- the model as verify runs it ---------------------------------------------------------------------
def disable_dropout_(model: nn.Module) -> list[str]:
    """Dropout off: every dropout module's p and every float attribute named like a dropout
    probability (attention modules that pass it to scaled_dot_product_attention) set to 0.
    Returns what was changed, as `path (p)`."""
    changed = []
    for path, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            changed.append(f"{path or '<root>'} ({m.p:g})")
            m.p = 0.0
        for attr, value in list(vars(m).items()):
            if isinstance(value, float) and 0 < value < 1 and ("dropout" in attr or "pdrop" in attr):
                changed.append(f"{path or '<root>'}.{attr} ({value:g})")
                setattr(m, attr, 0.0)
    return changed


def adapt_model(model: nn.Module, *, dtype: torch.dtype | None, keep_dropout: bool, log: list[str]) -> nn.Module:
    if dtype is not None:
        model = model.to(dtype)  # on the meta device: the engines materialize in this dtype
        if dtype == torch.float64 and hasattr(model, "hf_model"):  # experts with a float64 kernel
            from shardlab.models.hf_router import float64_experts_

            float64_experts_(model.hf_model)
    if not keep_dropout:
        log.extend(disable_dropout_(model))
    return model


# -- what a run records ------------------------------------------------------------------------------
_PROJECTIONS: dict[int, torch.Tensor] = {}


def fingerprint(out: torch.Tensor) -> torch.Tensor:
    """[rows, 3] per sample, float64: the sum of squares |x|^2 of its values, and two projections
    scaled so that each is at most |x| (Cauchy-Schwarz): the sum / sqrt(n) and a fixed random
    unit vector's. Outputs that differ are told apart with certainty in practice, at 3 numbers
    per sample instead of the activations."""
    x = out.detach().reshape(out.shape[0], -1).to("cpu", torch.float64)
    n = x.shape[1]
    if n not in _PROJECTIONS:
        _PROJECTIONS[n] = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    w = _PROJECTIONS[n]
    return torch.stack([(x * x).sum(1), x.sum(1) / n ** 0.5, x @ w / w.norm()], dim=1)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    if isinstance(value, dict) or hasattr(value, "values"):
        return next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
    return None


class ActivationRecorder:
    """Forward hooks on every module: while `on`, the first output of each module whose first
    dimension is the micro batch's rows is fingerprinted, during the model's own forward (an
    activation-checkpointing recompute, in backward, is ignored). The first-call order is the forward
    order. A module called more than once in one forward (Gemma 3's rotary embedding, once per layer
    type, in the order of a Python set: another order in every process) has no single output to
    compare: it is not recorded; the modules it feeds are."""

    def __init__(self, model: nn.Module, rows: int, reverse: bool):
        self.rows, self.reverse, self.on = rows, reverse, False
        self.prints: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.repeated: set[str] = set()
        self._in_forward, self._seen = False, set()
        self.handles = [model.register_forward_pre_hook(self._root_enter),
                        model.register_forward_hook(self._root_exit, always_call=True)]
        self.handles += [m.register_forward_hook(partial(self._hook, path)) for path, m in model.named_modules()]

    def _root_enter(self, module: nn.Module, args: Any) -> None:
        self._in_forward, self._seen = True, set()

    def _root_exit(self, module: nn.Module, args: Any, out: Any) -> None:
        self._in_forward = False

    def _hook(self, path: str, module: nn.Module, args: Any, out: Any) -> None:
        if not self.on or not self._in_forward:
            return
        if path in self._seen:
            self.repeated.add(path)
            if path in self.prints:
                del self.prints[path]
                self.order.remove(path)
            return
        self._seen.add(path)
        if path in self.prints or path in self.repeated:
            return
        t = _first_tensor(out)
        if t is None or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != self.rows:
            return
        fp = fingerprint(t)
        self.prints[path] = fp.flip(0) if self.reverse else fp  # back in the reference's row order
        self.order.append(path)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def gradient_pieces(engine) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """This rank's gradients by original name: {name: [(flat offset, values)]}, from the
    engine's shard layout (parameters without a gradient are absent)."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for p, pieces in engine.shard_layout():
        g = p.grad
        if g is None:
            continue
        flat = (g.to_local() if hasattr(g, "to_local") else g).detach().reshape(-1)
        for piece in pieces:
            values = flat[piece.local_start:piece.local_start + piece.numel].to("cpu", copy=True)
            out.setdefault(piece.name, []).append((piece.offset, values))
    return out


def full_gradients(pieces: list[dict], numel: dict[str, int]) -> dict[str, torch.Tensor]:
    """{name: flat float64 gradient} from every rank's pieces (the first holder of an element wins;
    elements nobody holds are zero, as a parameter no rank has a gradient for)."""
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in reversed(pieces):
        for name, items in rank_pieces.items():
            flat = out.setdefault(name, torch.zeros(numel[name], dtype=torch.float64))
            for offset, values in items:
                flat[offset:offset + values.numel()] = values.to(torch.float64)
    return out


def path_of(workdir: str, kind: str, name: str) -> str:
    return os.path.join(workdir, kind, name)


def _save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def target_counts(run, steps: int, world: int) -> list[list[list[int]]]:
    """[step][rank][micro batch] -> targets the loss counts (loss.count_targets): equal everywhere
    for fixed-length tokens and class labels, unequal for SFT rows with masked prompts and padding."""
    t, out = run.cfg.train, []
    for s in range(steps):
        per_rank = []
        for r in range(world):
            idx = run.sampler.rank_indices(s, r, world)
            ys = [collate(run.data.train, idx[i:i + t.micro_batch_size])[1] for i in range(0, len(idx), t.micro_batch_size)]
            per_rank.append([count_targets(y) for y in ys])
        out.append(per_rank)
    return out


def record_run(rt: Runtime, cfg, kind: str, plan: Plan, data) -> None:
    """Train the plan's steps (`Plan.steps`) of `cfg` through build_run/train_step and record them
    (see the module docstring). Every rank of `rt` calls it. In float64 the whole run, build and steps, is
    under `Float64Everywhere` ([Note: float32 islands in a float64 run])."""
    mode = Float64Everywhere() if plan.dtype == "float64" else contextlib.nullcontext()
    with mode:
        _record_run(rt, cfg, kind, plan, data, mode)


def _record_run(rt: Runtime, cfg, kind: str, plan: Plan, data, mode) -> None:
    t0 = time.perf_counter()
    os.makedirs(os.path.join(plan.workdir, kind), exist_ok=True)
    dropped: list[str] = []
    dtype = torch.float64 if plan.dtype == "float64" else None
    run = build_run(cfg, rt, data=data, adapt_model=partial(adapt_model, dtype=dtype,
                                                            keep_dropout=plan.keep_dropout, log=dropped))
    interleave = plan.nproc if kind != "engine" and rt.world_size == 1 else 1
    if hasattr(run.engine.unwrapped(), "router_groups"):  # [Note: the router loss across micro batches and ranks]
        run.engine.unwrapped().router_groups = interleave
    run.sampler = StepOrder(run.sampler, cfg.train.micro_batch_size, interleave, reverse=kind == "noise")
    b = run.batches  # the loop's DataLoader, reading in verify's order (micro batches, targets: unchanged)
    run.batches = StepBatches(b.dataset, run.sampler, rt.rank, rt.world_size, b.micro, b.end_step, b.device,
                              b.num_workers)
    run.model.train()
    model = run.engine.unwrapped()
    acts = ActivationRecorder(model, cfg.train.micro_batch_size, reverse=kind == "noise")
    grads: dict[int, dict] = {}

    def read_gradients(r, step: int) -> None:
        acts.on = False  # step 0's first micro batch is recorded by now
        grads[step] = gradient_pieces(r.engine)

    initial = shardlab.full_state_dict(run.model)  # every rank calls it; an update is measured from these values
    if rt.is_main:
        _save(_run_meta(run, model, plan, kind, initial), path_of(plan.workdir, kind, "meta.pt"))
    del initial
    try:
        for step in range(plan.steps):
            acts.on = step == 0
            result = train_step(run, before_clip=partial(read_gradients, step=step))
            _save(grads.pop(step), path_of(plan.workdir, kind, f"grads{step}.rank{rt.rank}.pt"))
            state = shardlab.full_state_dict(run.model)  # every rank calls it (a gather for sharded engines)
            if rt.is_main:
                _save({"loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped, "state": state},
                      path_of(plan.workdir, kind, f"step{step}.pt"))
            run.opt.zero_grad(set_to_none=True)
            run.state.step += 1
        _save({"prints": acts.prints, "order": acts.order, "seconds": time.perf_counter() - t0,
               "dropout_disabled": dropped, "float64": mode.summary() if isinstance(mode, Float64Everywhere) else None},
              path_of(plan.workdir, kind, f"acts.rank{rt.rank}.pt"))
    finally:
        acts.remove()
        del run, model
        gc.collect()  # the engine's cycles and its group's pending work go now ([Note: tearing down ...])


def _run_meta(run, model: nn.Module, plan: Plan, kind: str, initial: dict) -> dict[str, Any]:
    return {
        "world": run.rt.world_size,
        "micro": run.cfg.train.micro_batch_size,
        "accumulation": run.accumulation,
        "strategy": run.cfg.parallel.strategy,
        "param_order": [n for n, _ in model.named_parameters()],
        "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
        "buffers": [n for n, _ in model.named_buffers()],
        "module_types": {path: type(m).__name__ for path, m in model.named_modules()},
        "batchnorm": [path for path, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)],
        "num_parameters": run.num_parameters,
        "initial": initial,
        "targets": target_counts(run, plan.steps, run.rt.world_size) if kind == "engine" else None,
    }


# -- the worker --------------------------------------------------------------------------------------
def verify_worker(rt: Runtime, plan: Plan, compare: Callable[[Plan], Any] | None = None) -> Any:
    """Run the reference, the noise run and the engine; on rank 0 return compare(plan)."""
    engine_cfg, ref_cfg = config_from_dict(plan.engine), config_from_dict(plan.reference)
    data = build_datasets(engine_cfg)  # every rank, once (sft: local rank 0 prepares, the others wait)
    if plan.dtype == "float64":
        data.train = CastFloating(data.train, torch.float64)
    grouped = rt.distributed and rt.world_size > 1
    if plan.against == ONE_PROCESS:
        # the ranks without a one-process run wait for the others on a group of their own, with a
        # longer timeout (creating a group is collective: all ranks, now)
        wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=REFERENCE_WAIT_S)) if grouped else None
        solo = Runtime(0, rt.local_rank, 1, rt.device, None, rt.restart_count)
        for i, kind in enumerate(plan.references):
            if i % rt.world_size == rt.rank:
                record_run(solo, ref_cfg, kind, plan, data)
        if wait is not None:
            dist.barrier(group=wait)
            dist.destroy_process_group(wait)
    else:
        for kind in plan.references:
            record_run(rt, ref_cfg, kind, plan, data)
    record_run(rt, engine_cfg, "engine", plan, data)
    if grouped:
        dist.barrier()  # every rank's files are written
    if rt.is_main and compare is not None:
        return compare(plan)
    return None

