"""How a unit's own forward runs: activation checkpointing (none | full | selective) and
torch.compile. Every strategy gets both the same way, from `parallelize`, before the engine
wraps the model: the engines neither know nor care.

[Note: hooks outside, checkpoint and compile inside]
A unit's forward is replaced, on the instance, by a function that calls the original one:

    unit.__call__ -> engine pre-hook (gather) -> unit.forward -> engine post-hook (free)
                                                 = compile( checkpoint( original forward ) )

as torchtitan lays out a block (checkpoint wrapper, then torch.compile, then fully_shard):
- the engines' hooks stay outside the compiled graph, where they can communicate, and the
  graph is the block's arithmetic alone, one graph for all blocks of a class (dynamo guards
  on the code and the tensors' metadata, not on which block it is, so the graph compiled
  for block 0 serves the others: compile time does not grow with depth);
- the checkpoint is inside the compiled function, so dynamo traces it as one
  higher-order op and the partitioner decides what the backward graph recomputes;
  the selective policy below becomes its save list. In eager mode the same function
  recomputes by calling the original forward again inside backward: the unit's hooks do not
  fire again (the engines' pre-backward hook has re-gathered the parameters by then), only
  hooks of modules nested inside the unit do ([Note: forward hooks inside backward] in
  engines/_hooks.py: `_hooks.in_backward()` still tells them apart);
- the module's parameters and names are untouched: no `_orig_mod.` wrapper (what
  `torch.compile(module)` would add) reaches state dicts, checkpoints or exports.

[Note: what selective checkpointing saves]
Selective is torchtitan's op-level policy ("op" SAC): it keeps the outputs of the operators that
are expensive to recompute, and recomputes the rest in backward:
- the Linear layers' matrix products (mm, and addmm for a Linear with a bias), *every other one*
  in the order a unit's forward runs them: the 1st, 3rd, 5th ... are kept, the 2nd, 4th ... are
  recomputed. In a Llama block that keeps q, v, gate and down (23,552 values per token at
  hidden 4096) and recomputes k, o and up (19,456): about half the matmul outputs' memory for
  about a third of the block's matmul FLOPs again. The count starts at 0 in every checkpointed
  call (a fresh counter per `context_fn` call, as torchtitan's per-call `meta`), and forward and
  recompute count apart, so the recompute pass agrees with the forward on which product it
  finds saved. (torchtitan counts `mm` only: its models have no biases; a bias makes the same
  Linear an `addmm`, counted here alike, so a biased model gets the same every-other policy.)
- the fused attention kernels (CPU and CUDA flash, efficient, cuDNN), the batched products of
  attention on the math path (bmm, baddbmm) and convolutions: always.
Everything else (norms, activations, softmax, residual adds; dropout masks are replayed with the
saved RNG state) is recomputed. Full recomputes all of it and keeps only the unit's inputs.
Before 2026-11-23 selective kept every matmul output: 19 GiB more than torchtitan's on Llama 3.1
8B at 2 x 8192 tokens (docs/memory.md). Memory and time of the three modes are measured in
docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective")
#: torch.compile's modes, plus None (its default).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _ops(*names: str) -> frozenset:
    """The aten operators of these names (an op this torch build lacks is skipped)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


#: The Linear layers' products: every other one is kept (see the Note).
ALTERNATE_SAVE_OPS = _ops("mm", "addmm")
#: Always kept: attention (fused kernels, and its batched products on the math path) and convolutions.
ALWAYS_SAVE_OPS = _ops("bmm", "baddbmm", "convolution",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _every_other_matmul_policy() -> Callable[..., CheckpointPolicy]:
    """A policy for one checkpointed call: its own matmul counters, forward and recompute apart."""
    count = {False: 0, True: 0}  # ctx.is_recompute -> Linear products seen so far

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in ALTERNATE_SAVE_OPS:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        else:
            keep = op in ALWAYS_SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_every_other_matmul_policy())


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing of the wrap units: mode none | full | selective, applied to
    units 0, every, 2*every, ... (every=1: all of them)."""

    mode: str = "none"
    every: int = 1

    def __post_init__(self) -> None:
        if self.mode not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, not {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"ac_every must be >= 1, got {self.every}")

    @classmethod
    def parse(cls, value: Any, every: int = 1) -> Checkpointing:
        """Accept a Checkpointing, a mode name, or a bool (True: full, False: none)."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, bool) or value is None:
            return cls("full" if value else "none", every)
        return cls(str(value), every)

    def applies_to(self, index: int) -> bool:
        return self.mode != "none" and index % self.every == 0

    #: Of a unit's forward FLOPs, what selective runs again: every other Linear product (see the
    #: Note), 5/12 of a GPT block's matmul FLOPs and 0.37 of a Llama 3 8B block's: an estimate for
    #: plan's time model where no fake probe counted the real step's FLOPs.
    SELECTIVE_RECOMPUTED = 0.4

    def recomputed_share(self, units: int | None) -> float:
        """The share of the units' forward FLOPs that backward runs again: full recomputes its
        units whole, selective about `SELECTIVE_RECOMPUTED` of them (pointwise ops counted as 0);
        `units` None: every unit counts."""
        share = {"none": 0.0, "full": 1.0, "selective": self.SELECTIVE_RECOMPUTED}[self.mode]
        return share if not units else share * sum(map(self.applies_to, range(units))) / units


# -- the functions a unit's forward becomes ------------------------------------------------------
# Module-level, so that torch.compile sees the same code for every unit and every model and
# reuses what it compiled (see [Note: hooks outside, checkpoint and compile inside]).
def _plain(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def _full(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _selective(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)


_RUNNERS = {"none": _plain, "full": _full, "selective": _selective}


@functools.cache
def _compiled(mode_name: str, compile_mode: str | None) -> Callable[..., Any]:
    return torch.compile(_RUNNERS[mode_name], mode=compile_mode)


def apply_to_units(units: list[nn.Module], checkpointing: Checkpointing, compile: bool,
                   compile_mode: str | None = None) -> None:
    """Give each unit its checkpointed and/or compiled forward (the Note above). Units the
    policy leaves alone keep their forward untouched."""
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(str(m) for m in COMPILE_MODES)}, "
                         f"not {compile_mode!r}")
    compile_mode = None if compile_mode == "default" else compile_mode
    for i, unit in enumerate(units):
        mode = checkpointing.mode if checkpointing.applies_to(i) else "none"
        if mode == "none" and not compile:
            continue
        if "forward" in unit.__dict__:
            raise ValueError(f"unit {i} ({type(unit).__name__}) already has its own forward on the instance: "
                             "activation checkpointing or compile was applied to it before")
        runner = _compiled(mode, compile_mode) if compile else _RUNNERS[mode]
        unit.forward = functools.partial(runner, unit.forward)


# -- compile time ---------------------------------------------------------------------------------
# dynamo's and AOTAutograd's own timers: the whole compile of a frame (tracing, the forward's
# inductor compile) and the backward's, which AOTAutograd compiles lazily at the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds this process has spent compiling (torch.compile, both directions), so far."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS)


def graphs_compiled() -> int:
    """How many frames dynamo compiled in this process (a recompile counts again)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("_compile.compile_inner", ()))


class CompileClock:
    """Compile time of one run: `seconds()` since the clock was made (the process may have
    compiled before, e.g. an earlier run in the same test process)."""

    def __init__(self) -> None:
        self._start, self._graphs = compile_seconds(), graphs_compiled()

    def seconds(self) -> float:
        return max(0.0, compile_seconds() - self._start)  # max: torch._dynamo.reset() clears the timers

    def graphs(self) -> int:
        return max(0, graphs_compiled() - self._graphs)
