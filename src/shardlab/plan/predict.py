"""The prediction per engine: exact model state (plan/model.py), the probes' transients
(plan/probe.py) scaled to the real model (plan/scaling.py), the notes that say how."""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing as mp
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardlab.config import Config, ConfigError, ParallelConfig, strategies_taking, validate_for_world
from shardlab.data.loader import layout_for
from shardlab.engines import STRATEGIES, engine_class
from shardlab.memory import PARTS
from shardlab.plan import probe as P
from shardlab.plan.model import (
    built_state,
    chunked_instead,
    engine_config,
    in_child,
    model_state,
    n_layer,
    probe_param_bytes,
    state_by_rule,
)
from shardlab.plan.ops import scale_micro_batches
from shardlab.plan.scaling import deepest_probe, scale_census, scale_flops, scale_probe


@dataclass
class Prediction:
    engine: str
    nproc: int
    peak_bytes: int
    parts: dict[str, int]
    phase: str
    model_state: dict[str, int]          # params (+buffers), grads, optimizer: exact
    probed: bool = True
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0                  # parallel.offload=cpu: state kept in host memory (not in peak_bytes)
    probe: str = "fake"                  # the probe it rests on: "fake" (FakeTensorMode), "real" or "none"
    #: FLOPs one rank executes per step (matmuls, convolutions, attention; recomputation included),
    #: counted on the probe's step and scaled in depth; None where no probe ran at the real micro batch and sequence
    step_flops: float | None = None
    #: one change of the config ("train.loss=chunked", "parallel.accumulate=sharded": `alternative_configs`)
    #: -> the peak it was probed at, the same way
    alternatives: dict[str, int] = field(default_factory=dict)
    #: the operations one rank dispatches per step (plan/ops.py), scaled like `step_flops`: plan's clock
    census: dict | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("census")  # tuple keys: the report gives its totals by kind instead (its time's `operations`)
        return out


def default_engines(nproc: int) -> list[str]:
    """Every registered engine that runs at this world size."""
    return [e for e in STRATEGIES if engine_class(e).distributed or nproc == 1]


def predict_all(cfg: Config, nproc: int, engines: list[str] | None = None, per_node: int | None = None,
                probe: str = "auto") -> dict[str, Prediction]:
    """Predicted peak per rank (device memory), by part, for each engine at world size nproc
    (per_node: ranks per node, hybrid sharding's default shard group). probe: "auto" (fake
    tensors for every engine that can run on them, real ones for the rest), "fake" or "real".
    Each change of `alternative_configs` is probed too, for the engines it applies to
    (`Prediction.alternatives`)."""
    cfg = laid_out(cfg, nproc)
    out = _predict_all(cfg, nproc, engines, per_node, probe)
    if probe == "auto" and not any(p.probe == "fake" for p in out.values()):
        probe = "real"  # the fake probe failed (said once, _fake_failed), or none applied: as the config's
    for change, changed, applies in alternative_configs(cfg, nproc):
        probed = [e for e in out if applies(e)]
        for e, p in (_predict_all(changed, nproc, probed, per_node, probe) if probed else {}).items():
            if p.probed:
                out[e].alternatives[change] = p.peak_bytes
    return out


CHUNKED_LOSS = "train.loss=chunked"
SHARDED_ACCUMULATION = "parallel.accumulate=sharded"


def laid_out(cfg: Config, nproc: int) -> Config:
    """The config as it trains at `nproc` ranks: where the layout rule (data/loader.py) lowers the
    micro batch, a copy with the lowered one, so that plan probes, counts and times the micro batch
    and accumulation the run will have. ConfigError where no layout exists at `nproc`."""
    t = cfg.train
    layout = layout_for(t.global_batch_size, t.micro_batch_size, nproc)
    if not layout.lowered:
        return cfg
    out = copy.deepcopy(cfg)
    out.train.micro_batch_size = layout.micro
    return out


def accumulation(cfg: Config, nproc: int) -> int:
    """Micro batches per rank per step (k) of the layout at `nproc` ranks."""
    return layout_for(cfg.train.global_batch_size, cfg.train.micro_batch_size, nproc).accumulation


def alternative_configs(cfg: Config, nproc: int) -> list[tuple[str, Config, Callable[[str], bool]]]:
    """(change, the config with it, the engines it applies to) of the one-key changes plan probes
    beside the config: the chunked loss where the config asks for the full loss of a model that
    would chunk it (plan/model.py's `chunked_instead`: the same loss and gradients), and sharded
    accumulation where the step accumulates locally (k > 1), for the engines that take it (no
    unsharded gradient between micro batches, k x the gradient traffic)."""
    out: list[tuple[str, Config, Callable[[str], bool]]] = []
    if chunked_instead(cfg):
        chunked = copy.deepcopy(cfg)
        chunked.train.loss = "chunked"
        out.append((CHUNKED_LOSS, chunked, lambda e: True))
    if cfg.parallel.accumulate == "local" and accumulation(cfg, nproc) > 1:
        sharded = copy.deepcopy(cfg)
        sharded.parallel.accumulate = "sharded"
        takes = strategies_taking("accumulate")
        out.append((SHARDED_ACCUMULATION, sharded, lambda e: e in takes))
    return out


def _predict_all(cfg, nproc: int, engines: list[str] | None, per_node: int | None, probe: str) -> dict[str, Prediction]:
    engines = list(engines or default_engines(nproc))
    cfgs = {e: engine_config(cfg, e, nproc, per_node) for e in engines}
    for e, c in cfgs.items():
        if not engine_class(e).distributed and nproc != 1:
            raise ConfigError(f"engine {e} runs one process; --nproc {nproc} asks for {nproc}")
        validate_for_world(c, nproc)
    fake = {e: probe_kind(e, probe) == "fake" for e in engines}
    L = n_layer(cfg)
    layers = P.probe_layers(cfg.train, L)
    k = accumulation(cfg, nproc)
    states = {e: state_by_rule(cfgs[e], e, nproc) for e in engines}
    to_build = {e: cfgs[e].to_dict() for e in engines if states[e] is None}
    probe_psi = probe_param_bytes(cfg, max(x or 0 for x in layers))
    probe_ok = [e for e in engines
                if fake[e] or _probe_state_estimate(probe_psi, cfgs[e].parallel, e, nproc) <= P.PROBE_MAX_BYTES]
    why_not = {e: f"a real-tensor probe would need over {P.PROBE_MAX_BYTES / 2**30:.0f} GiB here "
                  "(SHARDLAB_PLAN_PROBE_MAX_GIB raises the limit)" for e in engines if e not in probe_ok}
    shapes = {e: P.probe_shape(cfg, fake[e]) for e in engines}
    # a fake probe of a shallow model, or of an engine whose layout a cut model lacks, runs it whole:
    # no scaling in depth at all
    depth = {e: [L] if fake[e] and L is not None and (L <= P.FAKE_WHOLE_DEPTH or engine_class(e).probe_whole_depth)
             else layers for e in engines}
    plans = {e: {"raw": cfgs[e].to_dict(), "fake": fake[e], "micro": shapes[e][0], "seq": shapes[e][1],
                 "layers": depth[e]} for e in probe_ok}
    probe_accumulation = min(k, 2)
    probes = {}
    try:  # one child builds the engines whose state only building tells, then runs every probe
        built, probes = in_child(_plan_child, to_build, plans, nproc, layers, probe_accumulation,
                                 timeout_s=P.PROBE_TIMEOUT_S)
        states.update(built)
    except RuntimeError as e:  # a kernel with no fake-tensor path for these dtypes (see _fake_failed)
        return _fake_failed(e, cfg, nproc, engines, per_node, probe, any(fake[x] for x in probe_ok))
    except mp.TimeoutError:  # the pool's exit terminates the probe
        why_not.update({e: f"the probes did not finish in {P.PROBE_TIMEOUT_S:g} s here "
                           "(SHARDLAB_PLAN_PROBE_TIMEOUT_S gives them longer)" for e in probe_ok})
        probes = {}
        states.update({e: model_state(cfgs[e], e, nproc) for e in to_build})
    out = {e: _predicted(e, cfgs[e], nproc, states[e], probes[e], (*shapes[e], L, depth[e])) if e in probes
           else _not_probed(e, nproc, states[e], why_not[e]) for e in engines}
    for e, p in out.items():
        if e in probes and shapes[e][2] == 1:  # counted at the real micro batch and sequence
            p.step_flops = scale_flops(probes[e], L) * k / probe_accumulation
            p.census = scale_micro_batches(scale_census(probes[e], L), k / probe_accumulation)
    return out


def _fake_failed(error: RuntimeError, cfg, nproc: int, engines, per_node, probe: str,
                 any_fake: bool) -> dict[str, Prediction]:
    """A probe on fake tensors that met a kernel whose fake (meta) path refuses what the real one
    takes: torch._grouped_mm's asks for bf16 as CUDA's does, where transformers' default experts
    of an MoE model in float32 call it (its CPU kernel takes float32, so a real probe runs).
    --probe auto probes on real tensors instead and says so; --probe fake says what to use."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not any_fake:
        raise error
    if probe == "fake":
        raise ConfigError(f"the probe on fake tensors failed ({first}); --probe real (or auto) probes on real ones")
    print(f"plan: the probe on fake tensors failed ({first}); probing on real tensors", file=sys.stderr, flush=True)
    return _predict_all(cfg, nproc, engines, per_node, "real")


PROBE_KINDS = ("auto", "fake", "real")


def probe_kind(engine: str, probe: str = "auto") -> str:
    """The probe an engine gets: fake tensors where it can run on them (`Engine.fake_tensor_probe`)."""
    if probe not in PROBE_KINDS:
        raise ConfigError(f"--probe must be one of {', '.join(PROBE_KINDS)}, got {probe!r}")
    can = engine_class(engine).fake_tensor_probe
    if probe == "fake" and not can:
        raise ConfigError(f"--probe fake: engine {engine} cannot run on fake tensors ({engine_class(engine).__name__}"
                          ".fake_tensor_probe is False); use --probe auto")
    return "fake" if can and probe != "real" else "real"


def _plan_child(to_build: dict[str, dict], plans: dict[str, dict], nproc: int, layers: list[int | None],
                accumulation: int) -> tuple[dict, dict]:
    """In one child process: each engine of `to_build` built on a fake group (its exact state),
    then the probes (plan/probe.py). A meta kernel that refuses its inputs is said by the parent in
    one line (_fake_failed), not by fake_tensor's logger with the traceback it re-raises anyway."""
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    built = {e: built_state(raw, e, nproc) for e, raw in to_build.items()}
    return built, (P.probe_child(plans, nproc, layers, accumulation) if plans else {})


def _not_probed(engine: str, nproc: int, state: dict[str, int], why: str) -> Prediction:
    parts = dict.fromkeys(PARTS, 0)
    # all three are live at the optimizer step, so their sum is a lower bound of the peak
    parts.update(params=state["params"], grads=state["grads"], optimizer=state["optimizer"])
    return Prediction(engine, nproc, sum(parts.values()), parts, "unknown", state, probed=False, probe="none",
                      notes=[f"not probed: {why}; the figure is parameters + gradients + optimizer "
                             "state, all live at the optimizer step (a lower bound)"])


def _predicted(engine: str, cfg: Config, nproc: int, state: dict[str, int], per_layer: dict, shape: tuple) -> Prediction:
    """An engine's probes scaled to the real model, with params and optimizer exact; the peak is
    the larger of the step candidate and the forward candidate."""
    micro, seq, act_scale, L, layers = shape
    cls = engine_class(engine)
    deepest = deepest_probe(per_layer)
    parts_step, parts_fwd = scale_probe(per_layer, L, act_scale, cls.grads_sharded)
    candidates = []
    for parts, phase in ((parts_step, deepest["phase"]), (parts_fwd, "forward")):
        if L is None or str(L) in per_layer:  # probed whole: the probed rank's gradients, as the planned rank's
            parts["grads"] = _planned_rank_grads(parts["grads"], deepest["end_parts"], state)
        parts["params"], parts["optimizer"] = state["params"], state["optimizer"]  # exact
        candidates.append((sum(parts.values()), parts, phase))
    total, parts, phase = max(candidates, key=lambda c: c[0])
    notes = []
    host = 0
    if cfg.parallel.offload == "cpu":
        # [Note: CPU offload] shards, their gradients and the optimizer state live in host memory;
        # the device holds what the probe saw besides them (gathered units, unsharded gradients
        # in flight, activations) plus a unit's shard on its way in or out, not modelled (1/S of a unit).
        host = sum(state.values())  # params + grads + optimizer, all of them, between steps too
        parts.update(params=0, grads=0, optimizer=0)
        total = sum(parts.values())
        notes.append(f"parallel.offload=cpu: {host / 2**30:.2f} GiB of shards, gradients and optimizer state per "
                     "rank in host memory (not in the peak); the optimizer step runs on the CPU")
    group = cfg.parallel.shard_size
    if cls.grads_sharded and group and group < nproc:
        notes.append(f"hybrid sharding: shards over {group} ranks, replicated {nproc // group} times "
                     f"(model state 1/{group}, not 1/{nproc})")
    kind = "fake" if deepest.get("fake") else "real"
    if kind == "real" and not cls.fake_group_probe and nproc > 1:
        notes.append("probed on a real 1-rank gloo group (it cannot run on real tensors on a fake group); "
                     "a replica's memory does not depend on N")
    if act_scale != 1:
        notes.append(f"activations scaled x{act_scale:g} from a probe micro batch of {micro} x {seq} tokens")
    if L is not None and L > max(x or 0 for x in layers):
        notes.append(f"extrapolated from probes at {', '.join(str(x) for x in layers)} of {L} blocks")
    notes.append(f"probed on {kind} tensors" + (" (FakeTensorMode: real shapes, no data)" if kind == "fake" else ""))
    if cfg.train.compile:
        notes.append("train.compile: probed eagerly (the live tracker cannot see compiled kernels); measured for a "
                     "gpt-mini block, compiled keeps as much for backward as eager (none, full) or less (selective): "
                     "docs/benchmarks.md")
    out = Prediction(engine, nproc, int(round(total)), {k: int(round(v)) for k, v in parts.items()}, phase, state,
                     notes=notes, host_bytes=host, probe=kind)
    out.probe_step_seconds = {k: v["step_seconds"] for k, v in per_layer.items()}  # type: ignore[attr-defined]
    return out


def _planned_rank_grads(grads: float, end: dict[str, int], state: dict[str, int]) -> float:
    """The gradients a moment of the probed rank (rank 0) holds, for the rank plan reports (the
    largest model state): where the two keep different tensors (zero3's owners), the same fraction
    of its end-of-step gradients as the probed rank held. Where they keep the same (every other
    engine on this rank), the probed rank's figure."""
    if end.get("params") == state["params"] or not end.get("grads"):
        return grads
    return grads * state["grads"] / end["grads"]


def predict(cfg: Config, engine: str, nproc: int) -> Prediction:
    return predict_all(cfg, nproc, [engine])[engine]


def _probe_state_estimate(psi: int, p: ParallelConfig, engine: str, nproc: int) -> int:
    """Rough bytes the probe of `engine` holds (model state of the probe model, of `psi` parameter
    bytes, + one gathered copy), to refuse probes that would not fit on this machine."""
    group = p.shard_size or nproc
    return int(psi * (5 if not engine_class(engine).grads_sharded else 4 / group + 2))
