"""`shardlab plan`: predict the peak memory per rank of every engine before launch, say whether it
fits a GPU, and predict step time and tokens/s at K nodes (docs/memory.md, "shardlab plan").

  shardlab plan CONFIG.yaml [key=value ...] --gpu T4|L4|A100-40|A100-80|H100|H200 --nproc N [--nodes K]
                [--interconnect NAME] [--engines a,b] [--json]

How the peak is predicted (per engine, per rank):

1. Model state, exactly. The model is built on the meta device (no memory) and each engine's
   layout rules give what a rank holds: `fsdp` and `zero3` are built for real on the meta device
   on a fake process group of N ranks (`torch.testing._internal.distributed.fake_pg`), so their
   padding and ownership are the engines' own; `ddp`, `single`, `torch-ddp` hold every tensor
   whole; `torch-fsdp` (FSDP2, which cannot be built on meta) is computed from its rule: every
   parameter split on dim 0 into N chunks of ceil(d0/N) rows, each rank's storage padded to one
   chunk. Parameters + buffers, gradients and optimizer state (AdamW: two moments + a 4-byte
   step per tensor; SGD with momentum: one buffer) are exact; the maximum over ranks is taken.
2. Everything transient (gathered parameters, unsharded gradients in flight, communication
   buffers, activations) from a probe: the engine itself runs a real training step on CPU, in
   this process, on a fake process group of N ranks (collectives return at once; the memory
   they use is allocated as in a real run), on the model cut to `PROBE_LAYERS` blocks, at a
   micro batch of at most `PROBE_TOKENS` tokens, measured by the live-memory tracker
   (shardlab.memory). The engine's real code runs, so its bounds (how many units are gathered,
   how many gradients are in flight) are measured, not assumed. Two figures per probe: the
   step's peak and the forward peak, each with its breakdown by part.
3. Scaled to the real model (`_scale_probe`): the sharded engines' step peak is the deeper
   probe's peak plus what each added block keeps between steps (their transients are bounded
   per unit, so they do not grow with depth); the replicated engines' parts and the forward
   peak are linear in depth; activations scale linearly in tokens per micro batch (the CPU
   attention kernel, as FlashAttention on a GPU, keeps no T x T score matrix; where a model
   materializes scores the quadratic term is NOT modelled: see docs/memory.md), and
   params/optimizer are replaced by their exact values. The predicted peak is the larger of
   the step candidate and the forward candidate (a larger batch moves the peak to where
   activations are largest). torch-ddp is probed on a real one-rank gloo group
   (REAL_GROUP_ENGINES). Hybrid sharding and offload: `engine_config`, docs/memory.md.

Time: compute from the probe's measured step time on this CPU (scaled by FLOPs) or, for a GPU,
6 * params * tokens FLOPs at `GPUS[...].peak_flops * MFU`; communication from an alpha-beta
model per collective (`INTERCONNECTS`, `comm_plan`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

#: Blocks of the model the probes run with (GPT's n_layer, an HF decoder's num_hidden_layers;
#: other models run whole).
PROBE_LAYERS = (3, 4)
#: Tokens (micro batch x sequence) a probe micro batch holds at most; activations scale from there.
PROBE_TOKENS = 256
#: A probe whose model state would exceed this is not run (the engine is then reported by its model state
#: only); SHARDLAB_PLAN_PROBE_MAX_GIB raises it on a machine with more memory to spare.
PROBE_MAX_BYTES = int(float(os.environ.get("SHARDLAB_PLAN_PROBE_MAX_GIB", "6")) * 2**30)
#: Seconds the probes of all engines may take together; past it the engines are reported by their
#: model state only. SHARDLAB_PLAN_PROBE_TIMEOUT_S changes it (a large model on a few CPU cores).
PROBE_TIMEOUT_S = float(os.environ.get("SHARDLAB_PLAN_PROBE_TIMEOUT_S", "1800"))

#: Engines probed on a real one-rank gloo group instead of the fake N-rank one: PyTorch's DDP
#: reducer does not run on a fake group, and a replicated engine's memory per rank does not
#: depend on N (every rank holds the same model, gradients, buckets and optimizer state).
REAL_GROUP_ENGINES = ("torch-ddp",)
ENGINES = ("single", "ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
SHARDED_ENGINES = ("zero3", "fsdp", "torch-fsdp")
PARTS = ("params", "gathered_params", "grads", "unsharded_grads", "optimizer", "activations", "comm", "other")


# -- GPUs -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as sold (GB = 1e9 bytes where the vendor says GB)
    bf16: bool                 # native bfloat16 (Ampere and newer)
    peak_flops: float          # dense tensor-core FLOP/s at the training dtype (bf16, or fp16 on T4), no sparsity
    source: str


# Vendor data sheets (dense, no structured sparsity). T4: 65 TFLOP/s fp16 tensor cores, no bf16
# (Turing). L4: 121 TFLOP/s bf16 dense (242 with sparsity). A100: 312 TFLOP/s bf16. H100 SXM:
# 989 TFLOP/s bf16 dense. H200: same compute as H100 SXM, 141 GB HBM3e.
GPUS: dict[str, GPU] = {
    "T4": GPU("T4", 16 * 10**9, False, 65e12, "NVIDIA T4 data sheet: 16 GB GDDR6, 65 TFLOPS fp16 tensor"),
    "L4": GPU("L4", 24 * 10**9, True, 121e12, "NVIDIA L4 data sheet: 24 GB, 242 TFLOPS bf16 with sparsity"),
    "A100-40": GPU("A100-40", 40 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 40 GB HBM2, 312 TFLOPS bf16"),
    "A100-80": GPU("A100-80", 80 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 80 GB HBM2e, 312 TFLOPS bf16"),
    "H100": GPU("H100", 80 * 10**9, True, 989e12, "NVIDIA H100 SXM data sheet: 80 GB HBM3, 989 TFLOPS bf16 dense"),
    "H200": GPU("H200", 141 * 10**9, True, 989e12, "NVIDIA H200 data sheet: 141 GB HBM3e, H100 compute"),
}
#: Memory no tensor can use: the CUDA context and libraries (cuBLAS/NCCL workspaces), ~0.5-1 GiB.
CUDA_CONTEXT_BYTES = 1 * 2**30
#: Of the rest, the fraction the caching allocator can hand out before fragmentation bites.
ALLOCATOR_USABLE_FRACTION = 0.90
#: Model FLOPs utilisation assumed for GPU step-time predictions (typical for FSDP training of
#: decoders at this scale: 30-50 % on A100/H100; stated, not measured here).
MFU = 0.40


def usable_bytes(gpu: GPU) -> int:
    return int((gpu.memory_bytes - CUDA_CONTEXT_BYTES) * ALLOCATOR_USABLE_FRACTION)


# -- interconnects (alpha-beta) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float             # latency per collective step (s)
    bandwidth: float           # bytes/s one rank can send (bus bandwidth)
    source: str
    #: (kind, alpha_s, bandwidth) that replace the pair above for one collective kind: gloo's
    #: kinds are implemented very differently (its reduce_scatter copies and all-reduces), so one
    #: pair cannot describe them all (docs/memory.md, "Step time").
    per_kind: tuple[tuple[str, float, float], ...] = ()

    def constants(self, kind: str) -> tuple[float, float]:
        for k, a, b in self.per_kind:
            if k == kind:
                return a, b
        return self.alpha_s, self.bandwidth


#: Per-link constants: alpha (latency per ring step) and bus bandwidth per rank. "loopback" is
#: fitted on this machine (docs/memory.md, `python -m shardlab.plan fit-loopback`); the others
#: are nominal figures from vendor specifications with a stated efficiency.
INTERCONNECTS: dict[str, Link] = {
    # 2026-11-23, `python -m shardlab.plan fit-loopback` (median of 15 calls per kind and size, 4 KiB-16 MiB),
    # timing the engines' own collectives (on CPU, all-gather and reduce-scatter in place: collectives.py):
    # per-kind mean |error| 19 % at the 2 fitted workers, 51 % at 4 (oversubscribed: 4 workers on 2 cores);
    # the constants moved by up to 3x between runs on this shared VM (docs/memory.md, "Step time").
    "loopback": Link("loopback", 211.7e-6, 1.548e9, "fitted here: gloo on 127.0.0.1, 2 workers, 2 CPU cores",
                     (("all_gather", 583.8e-6, 0.711e9), ("all_reduce", 394.7e-6, 0.914e9),
                      ("broadcast", 130.7e-6, 2.401e9), ("reduce", 483.2e-6, 1.041e9),
                      ("reduce_scatter", 799.5e-6, 0.414e9))),
    "pcie": Link("pcie", 10e-6, 0.8 * 16e9, "PCIe 4.0 x16: 32 GB/s per direction nominal; ~16 GB/s ring bus, 80 %"),
    "nvlink": Link("nvlink", 5e-6, 0.8 * 300e9, "NVLink 4 (H100): 450 GB/s per direction; ~300 GB/s NCCL bus, 80 %"),
    "infiniband-400": Link("infiniband-400", 5e-6, 0.8 * 50e9, "InfiniBand NDR 400 Gb/s = 50 GB/s per port, 80 %"),
    "ethernet-100": Link("ethernet-100", 30e-6, 0.7 * 12.5e9, "100 GbE = 12.5 GB/s, 70 % with TCP/NCCL sockets"),
}


# -- the result -------------------------------------------------------------------------------------------
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- model state, exactly ---------------------------------------------------------------------------------
def _cut_depth(raw: dict, n_layer: int, tmpdir: str) -> None:
    """Cut the model of config dict `raw` to `n_layer` blocks, in place: GPT's model.n_layer; for
    an HF model, a copy of its config with num_hidden_layers=n_layer written into tmpdir and used
    as model.hf_config (random init: a probe measures memory, which the values do not change;
    per-layer lists such as layer_types are cut to match)."""
    model = raw["model"]
    if model["name"] == "gpt":
        model["n_layer"] = n_layer
        return
    from types import SimpleNamespace

    from shardlab.models.hf import load_hf_config

    config = load_hf_config(SimpleNamespace(hf_path=model.get("hf_path"), hf_config=model.get("hf_config")))
    config.num_hidden_layers = n_layer
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layer]
    path = os.path.join(tmpdir, f"hf-config-{n_layer}-layers.json")
    config.to_json_file(path)
    model.update(hf_path=None, hf_config=path)


def _probe_config(cfg, n_layer: int | None, micro: int, seq: int, world: int, steps: int, accumulation: int,
                  tmpdir: str):
    from shardlab.config import config_from_dict

    raw = cfg.to_dict()
    if n_layer is not None:
        _cut_depth(raw, n_layer, tmpdir)
    raw["data"]["seq_len"] = seq
    raw["train"].update(micro_batch_size=micro, global_batch_size=micro * world * accumulation, steps=steps,
                        memory_tracking="none", eval_every=0, profile=False)
    if cfg.model.name == "gpt":  # the probe's data: synthetic tokens with the real vocabulary
        raw["model"]["vocab_size"] = _vocab_size(cfg)
    # synthetic tokens of the same shape: memory does not depend on their values; SFT's packing
    # changes only which tokens attend to which (a mask of the same size), so it is dropped here
    raw["data"].update(source="synthetic", path=None, tokenizer=None, tokenizer_path=None, packing=False,
                       synthetic_samples=max(64, 4 * micro * world))
    raw["checkpoint"].update(every_steps=0, resume="none")
    raw["output"].update(tensorboard=False, progress=False, run_name="plan-probe")
    return config_from_dict(raw)


def _vocab_size(cfg) -> int | None:
    if cfg.model.name != "gpt":
        return None
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.source in ("builtin", "text"):
        from shardlab.data.text import Tokenizer

        return Tokenizer(cfg.data.tokenizer).vocab_size
    from shardlab.models import MODELS

    return MODELS["gpt"].synthetic(cfg.model).get("vocab_size")


def _meta_model(cfg):
    from shardlab.models import build_model

    return build_model(cfg.model, seed=cfg.seed, vocab_size=_vocab_size(cfg), device="meta")


def _optimizer_bytes(cfg, tensors: list[tuple[int, int]]) -> int:
    """(numel, element size) of each trainable local tensor -> optimizer state bytes."""
    t = cfg.train
    if t.optimizer == "adamw":
        return sum(2 * n * e + 4 for n, e in tensors)  # exp_avg, exp_avg_sq, a 0-dim fp32 step
    return sum(n * e for n, e in tensors) if t.momentum > 0 else 0


def engine_config(cfg, engine: str, world: int, per_node: int | None = None):
    """The config as `engine` would run it: options it does not take are dropped (shard_size
    outside fsdp/torch-fsdp, offload outside the sharded engines), and hybrid sharding's
    default S, the ranks per node, is made explicit (`per_node`, from --nproc)."""
    from shardlab.config import HYBRID_STRATEGIES, OFFLOAD_STRATEGIES

    c = copy.deepcopy(cfg)
    c.parallel.strategy = engine
    if engine not in HYBRID_STRATEGIES:
        c.parallel.shard_size = None
    elif c.parallel.shard_size is None:
        c.parallel.shard_size = per_node if per_node and per_node < world else world
    if engine not in OFFLOAD_STRATEGIES:
        c.parallel.offload = "none"
    return c


def model_state(cfg, engine: str, nproc: int) -> dict[str, int]:
    """Exact bytes per rank (the maximum over ranks) of parameters + buffers, gradients and
    optimizer state the engine keeps between steps. Runs in a child process when an engine
    must be built on a fake process group (so this process keeps no process group)."""
    model = _meta_model(cfg)
    params = list({id(p): p for p in model.parameters()}.values())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if engine in ("single", "ddp", "torch-ddp") or nproc == 1 and engine != "fsdp":
        trainable = [(p.numel(), p.element_size()) for p in params if p.requires_grad]
        return {"params": sum(p.numel() * p.element_size() for p in params) + buffers,
                "grads": sum(n * e for n, e in trainable), "optimizer": _optimizer_bytes(cfg, trainable)}
    if engine == "torch-fsdp":
        # FSDP2: Shard(0) per parameter over the shard group (S ranks; S = N unless hybrid);
        # every rank's storage padded to ceil(d0/S) rows.
        group = cfg.parallel.shard_size or nproc
        local, trainable = 0, []
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            per_rank = math.ceil(rows / group) * (p.numel() // rows if rows else 0)
            local += per_rank * p.element_size()
            if p.requires_grad:
                trainable.append((per_rank, p.element_size()))
        return {"params": local + buffers, "grads": sum(n * e for n, e in trainable),
                "optimizer": _optimizer_bytes(cfg, trainable)}
    return _in_child(_layout_state_child, cfg.to_dict(), engine, nproc)


def _layout_state_child(raw: dict, engine: str, nproc: int) -> dict[str, int]:
    """fsdp / zero3 built on the meta device on a fake N-rank group: their own layout."""
    import torch.distributed as dist

    import shardlab
    from shardlab.config import config_from_dict
    from shardlab.train import engine_options

    cfg = config_from_dict(raw)
    best: dict[str, int] | None = None
    ranks = [0, nproc - 1] if engine == "fsdp" else [0]  # fsdp: padding only shrinks the last shard
    for rank in ranks:
        _init_fake(rank, nproc)
        try:
            cfg.parallel.strategy = engine
            options = {k: v for k, v in engine_options(cfg).items() if k != "offload"}  # where, not how much
            m = shardlab.parallelize(_meta_model(cfg), engine, device="meta", **options)
            e = shardlab.engine_of(m)
            if engine == "zero3":  # ownership of every rank is known on any rank
                per_rank: dict[int, list] = {r: [] for r in range(nproc)}
                for s in e.slots:
                    per_rank[s.owner].append(s)
                buffers = sum(b.numel() * b.element_size() for b in e.unwrapped().buffers())
                for slots in per_rank.values():
                    size = lambda s: s.numel * _elem(s.dtype)  # noqa: E731
                    tr = [(s.numel, _elem(s.dtype)) for s in slots if s.requires_grad]
                    st = {"params": sum(size(s) for s in slots) + buffers, "grads": sum(n * x for n, x in tr),
                          "optimizer": _optimizer_bytes(cfg, tr)}
                    if best is None or sum(st.values()) > sum(best.values()):
                        best = st
            else:
                local = e.local_parameters()
                buffers = sum(b.numel() * b.element_size() for b in e.unwrapped().buffers())
                tr = [(p.numel(), p.element_size()) for p in local if p.requires_grad]
                st = {"params": sum(p.numel() * p.element_size() for p in local) + buffers,
                      "grads": sum(n * x for n, x in tr), "optimizer": _optimizer_bytes(cfg, tr)}
                if best is None or sum(st.values()) > sum(best.values()):
                    best = st
        finally:
            dist.destroy_process_group()
    assert best is not None
    return best


def _elem(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _init_fake(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


# -- the probe ----------------------------------------------------------------------------------------
def _probe_child(raws: dict[str, dict], nproc: int, layers: list[int | None], micro: int, seq: int,
                 accumulation: int) -> dict:
    """Run each engine for real on a fake N-rank group at each probe depth: an untracked step
    (creates optimizer state), a tracked step (the peak) and a step whose forward alone is
    tracked (the forward peak). raws: each engine's config (engine_config). Returns
    {engine: {layers: {...}}}. REAL_GROUP_ENGINES run last, on a real one-rank group."""
    import tempfile

    import torch
    import torch.distributed as dist

    from shardlab import memory
    from shardlab.config import config_from_dict
    from shardlab.runtime import Runtime
    from shardlab.train import build_run, train_step

    torch.set_num_threads(1)
    out: dict = {}
    _init_fake(0, nproc)
    rt = Runtime(0, 0, nproc, torch.device("cpu"), "fake")
    tmp = tempfile.TemporaryDirectory(prefix="shardlab-plan-")
    for engine in sorted(raws, key=lambda e: e in REAL_GROUP_ENGINES):
        cfg0 = config_from_dict(raws[engine])
        if engine in REAL_GROUP_ENGINES and rt.backend == "fake":
            # see REAL_GROUP_ENGINES: a real one-rank gloo group (a FileStore, no network)
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.FileStore(f"{tmp.name}/store", 1), rank=0, world_size=1)
            rt = Runtime(0, 0, 1, torch.device("cpu"), "gloo")
        out[engine] = {}
        for L in layers:
            cfg = _probe_config(cfg0, L, micro, seq, rt.world_size, 3, accumulation, tmp.name)
            run = build_run(cfg, rt)
            run.model.train()
            train_step(run)
            run.opt.zero_grad(set_to_none=True)
            run.state.step += 1
            tracker = memory.LiveMemoryTracker(rt.device, engine=run.engine, optimizer=run.opt)
            t0 = time.perf_counter()
            with tracker.step(1):
                train_step(run, tracker)
            seconds = time.perf_counter() - t0
            full = tracker.summary()
            tracker.close()
            run.opt.zero_grad(set_to_none=True)
            run.state.step += 1
            # the forward peak: only the forward of the last micro batch (after the no_sync ones) is tracked
            fwd = _forward_peak(run, rt)
            out[engine][str(L)] = {"peak": full["peak_live_bytes"], "parts": full["parts"], "phase": full["phase"],
                                   "fwd_peak": fwd["peak_live_bytes"], "fwd_parts": fwd["parts"],
                                   "end_parts": (full["step_end"] or {}).get("parts", {}),
                                   "step_seconds": seconds}
            del run, tracker
    dist.destroy_process_group()
    tmp.cleanup()
    return out


def _forward_peak(run, rt) -> dict:
    import contextlib

    import shardlab
    from shardlab import memory
    from shardlab.amp import autocast
    from shardlab.data import collate

    t = run.cfg.train
    idx = run.sampler.rank_indices(run.state.step, rt.rank, rt.world_size)
    for i in range(run.accumulation):
        x, y = collate(run.data.train, idx[i * t.micro_batch_size:(i + 1) * t.micro_batch_size])
        last = i == run.accumulation - 1
        with contextlib.nullcontext() if last else shardlab.no_sync(run.model):
            if last:
                tracker = memory.LiveMemoryTracker(rt.device, engine=run.engine, optimizer=run.opt)
                with tracker.step(2), tracker.phase("forward"), autocast(t.precision, rt.device):
                    loss = run.model(x, y) / run.accumulation
                summary = tracker.summary()
                tracker.close()
            else:
                with autocast(t.precision, rt.device):
                    loss = run.model(x, y) / run.accumulation
            loss.backward()
    run.opt.zero_grad(set_to_none=True)
    return summary


def _in_child(fn, *args, timeout_s: float = 1800.0):
    """Run fn(*args) in a spawned process (its own process group and memory); return its result."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        res = pool.apply_async(fn, args)
        return res.get(timeout_s)


# -- scaling ------------------------------------------------------------------------------------------
def _probe_shape(cfg) -> tuple[int, int, float]:
    """(micro batch, seq) the probe runs at and the factor activations scale by."""
    b, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    pb, ps = b, seq
    while pb * ps > PROBE_TOKENS and pb > 1:
        pb = max(1, pb // 2)
    while pb * ps > PROBE_TOKENS and ps > 16:
        ps = max(16, ps // 2)
    return pb, ps, (b * seq) / (pb * ps)


def _scale_probe(per_layer: dict[str, dict], L: int | None, act_scale: float, sharded: bool) -> tuple[dict, dict]:
    """Parts at the real model's step peak and forward peak, from probes at two depths.

    [Note: scaling a probe's peak to the real depth]
    A step's peak falls near the end of backward (or, with large activations, at its start).
    At the end of backward every block but the last few holds what it keeps between steps
    (shard, gradient, optimizer state, ddp's bucket) and the rest is transient: the units an
    engine has gathered or is reducing, which its bounds cap (MAX_UNITS_REDUCING, prefetch),
    so the transient does not grow with depth. Hence the step peak of L blocks is the deepest
    probe's peak plus, per block added, what one block keeps between steps (the probes'
    difference in step-end state, by part: exact, as per-block state is the same in every
    block). Extrapolating each part of the peak linearly instead is off by whole units: which
    parts a peak catches half-done moves between shallow probes (fsdp on gpt2-small, sharded
    gradients at the peak: 13.5 MiB at 2 and 3 blocks, 27.0 at 4, 135.2 at 12).
    That holds for the sharded engines (units, bounded). A replicated engine (ddp, torch-ddp,
    single) has no units: every part of its peak is per-block state or per-block fresh
    gradients (ddp keeps autograd's gradients beside its buckets until backward ends), so each
    part is extrapolated linearly in depth.
    The forward peak (end of forward: saved activations of every block) is linear in depth
    part by part, and is the candidate that wins when activations dominate. Then a sharded
    engine's step peak comes at the start of backward: the forward's activations plus the
    head's backward (the logits' gradient), not yet freed by any block. The probes show it:
    their step peaks' activations grow between the two depths as the forward's do (within
    5 %): both peaks caught the same moment, and each part is extrapolated linearly, as for a
    replicated engine (the blocks' gradients, which the end-of-backward rule adds per block,
    do not exist yet there).
    Activations scale with tokens per micro batch in both.
    """
    keys = sorted(int(k) for k in per_layer if k != "None")
    if L is None or not keys:
        v = per_layer[str(keys[-1]) if keys else "None"]
        step, fwd = dict(v["parts"]), dict(v["fwd_parts"])
    else:
        hi = per_layer[str(keys[-1])]
        lo = per_layer[str(keys[0])] if len(keys) > 1 else hi
        blocks = (L - keys[-1]) / (keys[-1] - keys[0]) if len(keys) > 1 else 0.0
        act_step = hi["parts"].get("activations", 0) - lo["parts"].get("activations", 0)
        act_fwd = hi["fwd_parts"].get("activations", 0) - lo["fwd_parts"].get("activations", 0)
        at_backward_start = act_fwd > 0 and abs(act_step - act_fwd) <= 0.05 * act_fwd
        growth = "end_parts" if sharded and not at_backward_start else "parts"
        step = {p: hi["parts"].get(p, 0) + blocks * (hi[growth].get(p, 0) - lo[growth].get(p, 0)) for p in PARTS}
        fwd = {p: hi["fwd_parts"].get(p, 0) + blocks * (hi["fwd_parts"].get(p, 0) - lo["fwd_parts"].get(p, 0))
               for p in PARTS}
    # Only activations scale with tokens: of the step peak's "activations" (what was born in
    # forward or backward and nobody claimed), at most the forward's saved activations are; the
    # rest is backward-born storage of fixed size (PyTorch DDP's buckets on the one-rank probe).
    saved = min(step.get("activations", 0), fwd.get("activations", 0))
    step["activations"] = step.get("activations", 0) + (act_scale - 1) * saved
    fwd["activations"] = fwd.get("activations", 0) * act_scale
    return step, fwd


def _tokens_per_sample(cfg) -> int:
    """Tokens a sample holds for the FLOP count: seq_len for the language models (gpt, hf), one
    "token" per image for the vision ones."""
    return cfg.data.seq_len if cfg.model.name in ("gpt", "hf") else 1


def _n_layer(cfg) -> int | None:
    """Blocks of a model whose depth the probes cut (GPT's n_layer, an HF decoder's
    num_hidden_layers); None for models that run whole (ResNet, MLP)."""
    if cfg.model.name == "hf":
        from shardlab.models.hf import load_hf_config

        return load_hf_config(cfg.model).num_hidden_layers
    if cfg.model.name != "gpt":
        return None
    from shardlab.models.gpt import gpt_config

    return gpt_config(cfg.model).n_layer


def predict_all(cfg, nproc: int, engines: list[str] | None = None, per_node: int | None = None
                ) -> dict[str, Prediction]:
    """Predicted peak per rank (device memory), by part, for each engine at world size nproc
    (per_node: ranks per node, hybrid sharding's default shard group)."""
    from shardlab.config import ConfigError, validate_for_world

    engines = list(engines or [e for e in ENGINES if e != "single" or nproc == 1])
    cfgs = {e: engine_config(cfg, e, nproc, per_node) for e in engines}
    for e, c in cfgs.items():
        if e == "single" and nproc != 1:
            raise ConfigError(f"engine single runs one process; --nproc {nproc} asks for {nproc}")
        validate_for_world(c, nproc)
    L = _n_layer(cfg)
    layers: list[int | None] = [min(x, L) for x in PROBE_LAYERS] if L is not None else [None]
    layers = sorted(set(layers), key=lambda x: -1 if x is None else x)
    micro, seq, act_scale = _probe_shape(cfg)
    accumulation = cfg.train.global_batch_size // (nproc * cfg.train.micro_batch_size)
    states = {e: model_state(cfgs[e], e, nproc) for e in engines}
    probe_psi = _probe_param_bytes(cfg, max(x or 0 for x in layers))
    probe_ok = [e for e in engines if _probe_state_estimate(probe_psi, cfgs[e], e, nproc) <= PROBE_MAX_BYTES]
    why_not = {e: f"the probe would need over {PROBE_MAX_BYTES / 2**30:.0f} GiB here (SHARDLAB_PLAN_PROBE_MAX_GIB "
                  "raises the limit)" for e in engines if e not in probe_ok}
    probes = {}
    if probe_ok:
        try:
            probes = _in_child(_probe_child, {e: cfgs[e].to_dict() for e in probe_ok}, nproc, layers, micro, seq,
                               min(accumulation, 2), timeout_s=PROBE_TIMEOUT_S)
        except mp.TimeoutError:  # the pool's exit terminates the probe
            why_not.update({e: f"the probes did not finish in {PROBE_TIMEOUT_S:g} s here "
                               "(SHARDLAB_PLAN_PROBE_TIMEOUT_S gives them longer)" for e in probe_ok})
    out = {}
    for e in engines:
        state = states[e]
        if e not in probes:
            parts = dict.fromkeys(PARTS, 0)
            # all three are live at the optimizer step, so their sum is a lower bound of the peak
            parts.update(params=state["params"], grads=state["grads"], optimizer=state["optimizer"])
            out[e] = Prediction(e, nproc, sum(parts.values()), parts, "unknown", state, probed=False,
                                notes=[f"not probed: {why_not[e]}; the figure is parameters + gradients + optimizer "
                                       "state, all live at the optimizer step (a lower bound)"])
            continue
        per_layer = probes[e]
        deepest = per_layer[max(per_layer, key=lambda k: -1 if k == "None" else int(k))]
        parts_step, parts_fwd = _scale_probe(per_layer, L, act_scale, e in SHARDED_ENGINES)
        candidates = []
        for parts, phase in ((parts_step, deepest["phase"]), (parts_fwd, "forward")):
            parts["params"], parts["optimizer"] = state["params"], state["optimizer"]  # exact
            candidates.append((sum(parts.values()), parts, phase))
        total, parts, phase = max(candidates, key=lambda c: c[0])
        notes = []
        host = 0
        if cfgs[e].parallel.offload == "cpu":
            # [Note: CPU offload] shards, their gradients and the optimizer state live in host memory;
            # the device holds what the probe saw besides them (gathered units, unsharded gradients
            # in flight, activations) plus a unit's shard on its way in or out, not modelled (1/S of a unit).
            host = sum(state.values())  # params + grads + optimizer, all of them, between steps too
            parts.update(params=0, grads=0, optimizer=0)
            total = sum(parts.values())
            notes.append(f"parallel.offload=cpu: {host / 2**30:.2f} GiB of shards, gradients and optimizer state per "
                         "rank in host memory (not in the peak); the optimizer step runs on the CPU")
        group = cfgs[e].parallel.shard_size
        if e in SHARDED_ENGINES and group and group < nproc:
            notes.append(f"hybrid sharding: shards over {group} ranks, replicated {nproc // group} times "
                         f"(model state 1/{group}, not 1/{nproc})")
        if e in REAL_GROUP_ENGINES and nproc > 1:
            notes.append("probed on a real 1-rank gloo group (its DDP reducer does not run on a fake group); "
                         "a replica's memory does not depend on N")
        if act_scale != 1:
            notes.append(f"activations scaled x{act_scale:g} from a probe micro batch of {micro} x {seq} tokens")
        if L is not None and L > max(x or 0 for x in layers):
            notes.append(f"extrapolated from probes at {', '.join(str(x) for x in layers)} of {L} blocks")
        out[e] = Prediction(e, nproc, int(round(total)), {k: int(round(v)) for k, v in parts.items()}, phase, state,
                            notes=notes, host_bytes=host)
        out[e].probe_step_seconds = {k: v["step_seconds"] for k, v in per_layer.items()}  # type: ignore[attr-defined]
    return out


def predict(cfg, engine: str, nproc: int) -> Prediction:
    return predict_all(cfg, nproc, [engine])[engine]


def _probe_param_bytes(cfg, layers: int) -> int:
    """Parameter bytes of the probe model (the model cut to `layers` blocks; the same for every engine)."""
    import tempfile

    from shardlab.config import config_from_dict

    raw = cfg.to_dict()
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-") as tmp:
        if layers and cfg.model.name in ("gpt", "hf"):
            _cut_depth(raw, layers, tmp)
        model = _meta_model(config_from_dict(raw))
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _probe_state_estimate(psi: int, cfg, engine: str, nproc: int) -> int:
    """Rough bytes the probe of `engine` holds (model state of the probe model, of `psi` parameter
    bytes, + one gathered copy), to refuse probes that would not fit on this machine."""
    group = cfg.parallel.shard_size or nproc
    return int(psi * (5 if engine not in SHARDED_ENGINES else 4 / group + 2))


# -- time: alpha-beta per collective --------------------------------------------------------------
def collective_time(kind: str, nbytes: float, world: int, link: Link) -> float:
    """Ring model: all_reduce 2(W-1) steps moving 2(W-1)/W of the buffer per rank; all_gather and
    reduce_scatter (W-1) steps moving (W-1)/W of the full buffer; broadcast (pipelined chain)
    ceil(log2 W) latency steps and the whole buffer once. nbytes: the full (unsharded) size."""
    if world <= 1:
        return 0.0
    steps, bus = {"all_reduce": (2 * (world - 1), 2 * (world - 1) / world),
                  "all_gather": (world - 1, (world - 1) / world),
                  "reduce_scatter": (world - 1, (world - 1) / world),
                  "broadcast": (math.ceil(math.log2(world)), 1.0),
                  "reduce": (math.ceil(math.log2(world)), 1.0)}[kind]
    alpha, bandwidth = link.constants(kind)
    return steps * alpha + bus * nbytes / bandwidth


def comm_plan(cfg, engine: str, world: int) -> list[tuple[str, float, int, int]]:
    """(kind, full bytes per call, calls per step, ranks in the group) of an engine's training
    collectives: what its design says it sends (docs/engines.md): ddp Psi all-reduced once per
    step in buckets; zero3 broadcasts every unit in forward and backward and reduces its
    gradients; fsdp/torch-fsdp all-gather every unit in forward and again in backward (not the
    root, kept gathered) and reduce-scatter the gradients once per step, all within the shard
    group of S ranks; with hybrid sharding (S < N) each unit's reduced 1/S gradient shard is then
    all-reduced across the N/S replicas."""
    if engine == "single" or world == 1:
        return []
    from shardlab.models import repeated_blocks

    model = _meta_model(cfg)
    units = repeated_blocks(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    params = list({id(p): p for p in model.parameters()}.values())
    mp_bytes = {"bf16": 2, "fp16": 2}.get(cfg.parallel.mixed_precision)
    def nbytes(ps):  # noqa: E306
        return sum(p.numel() * (mp_bytes or p.element_size()) for p in ps)
    total = nbytes(params)
    trainable = nbytes([p for p in params if p.requires_grad])
    root_bytes = nbytes([p for p in params if id(p) not in in_units])
    micro = max(1, cfg.train.global_batch_size // (world * cfg.train.micro_batch_size))
    if engine in ("ddp", "torch-ddp"):
        bucket = int(cfg.parallel.bucket_size_mb * 2**20)
        calls = max(1, math.ceil(trainable / bucket))
        return [("all_reduce", trainable / calls, calls, world)]
    n = len(units) + 1
    group = (cfg.parallel.shard_size or world) if engine in ("fsdp", "torch-fsdp") else world
    gather = "broadcast" if engine == "zero3" else "all_gather"
    out = [(gather, total / n, n * micro, group)]                  # forward: every unit, every micro batch
    again = total - (root_bytes if engine != "zero3" else 0)      # backward: again (fsdp keeps the root)
    out.append((gather, again / max(1, n - (engine != "zero3")), (n - (engine != "zero3")) * micro, group))
    out.append(("reduce" if engine == "zero3" else "reduce_scatter", trainable / n, n, group))
    if group < world:
        out.append(("all_reduce", trainable / n / group, n, world // group))
    return [e for e in out if e[3] > 1]


def comm_seconds(cfg, engine: str, world: int, link: Link) -> float:
    return sum(calls * collective_time(kind, b, ranks, link) for kind, b, calls, ranks in comm_plan(cfg, engine, world))


def _param_count(cfg) -> int:
    return sum(p.numel() for p in {id(p): p for p in _meta_model(cfg).parameters()}.values())


def step_time(cfg, engine: str, world: int, link: Link, gpu: GPU | None, probe_seconds: float | None,
              nodes: int = 1) -> dict[str, Any]:
    """Predicted step time: compute (GPU: 6*Psi*tokens at peak FLOP/s x MFU; CPU: the probe's
    measured step) and communication (alpha-beta); overlapped = max(compute, comm) for engines that
    overlap (all do: bucketed all-reduce, prefetch), serial = compute + comm."""
    t = cfg.train
    tokens_rank = t.global_batch_size // world * _tokens_per_sample(cfg)
    flops = (8 if t.activation_checkpointing else 6) * _param_count(cfg) * tokens_rank
    if gpu is not None:
        compute = flops / (gpu.peak_flops * MFU)
        source = f"6*Psi*tokens at {gpu.peak_flops / 1e12:.0f} TFLOP/s x MFU {MFU:g}"
    else:
        compute = probe_seconds or float("nan")
        source = "the probe's measured step on this CPU, scaled"
    comm = comm_seconds(cfg, engine, world, link)
    overlapped = max(compute, comm)
    tokens_step = t.global_batch_size * _tokens_per_sample(cfg)
    return {"compute_s": compute, "comm_s": comm, "step_s": overlapped, "step_serial_s": compute + comm,
            "tokens_per_s": tokens_step / overlapped if overlapped else None, "compute_source": source,
            "comm_hidden": comm <= compute, "link": link.name}


def hiding_limit(cfg, engine: str, per_node: int, link: Link, compute_s: float, max_nodes: int = 1024) -> int | None:
    """The first node count (at fixed micro batch per rank) at which the step's communication
    exceeds its compute, i.e. stops hiding behind it; None if it never does up to max_nodes."""
    c = copy.deepcopy(cfg)
    k = 1
    while k <= max_nodes:
        world = per_node * k
        c.train.global_batch_size = cfg.train.micro_batch_size * world * max(
            1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * per_node))
        if comm_seconds(c, engine, world, link) > compute_s:
            return k
        k *= 2
    return None


# -- verdict -----------------------------------------------------------------------------------------
def verdict(cfg, p: Prediction, gpu: GPU, others: dict[str, Prediction], world: int) -> dict[str, Any]:
    usable = usable_bytes(gpu)
    precision_problem = None
    if not gpu.bf16 and "bf16" in (cfg.train.precision, cfg.parallel.mixed_precision):
        precision_problem = (f"{gpu.name} has no bf16 (Turing): use train.precision=fp16 "
                             "parallel.mixed_precision=fp16 (dynamic loss scaling turns on with it)")
    fits = p.peak_bytes <= usable and precision_problem is None and p.probed
    out: dict[str, Any] = {"usable_bytes": usable, "fits": fits, "margin_bytes": usable - p.peak_bytes,
                           "changes": []}
    ch = out["changes"]
    if precision_problem:
        ch.append(precision_problem)
    if p.peak_bytes <= usable:
        return out
    sharded_state = p.parts["params"] + p.parts["grads"] + p.parts["optimizer"]
    if p.engine in ("zero3", "fsdp", "torch-fsdp") and sharded_state > 0:
        rest = p.peak_bytes - sharded_state
        if rest < usable:
            need = math.ceil(world * sharded_state / (usable - rest))
            ch.append(f"more ranks: about {need} in all (model state {sharded_state / 2**30:.1f} GiB/rank now "
                      f"scales as 1/N; the other {rest / 2**30:.1f} GiB do not); check with --nproc")
        else:
            ch.append(f"more ranks alone cannot help: {rest / 2**30:.1f} GiB of the peak do not shrink with N")
    else:
        fitting = [e for e, q in others.items() if q.probed and q.peak_bytes <= usable]
        ch.append("a sharded engine: " + (", ".join(f"{e} ({others[e].peak_bytes / 2**30:.1f} GiB)" for e in fitting)
                                           if fitting else "zero3/fsdp/torch-fsdp (none fits at this N either)"))
    act = p.parts["activations"]
    if act > 0.1 * p.peak_bytes and not cfg.train.activation_checkpointing:
        ch.append(f"train.activation_checkpointing=true (activations are {act / 2**30:.1f} GiB of the peak; "
                  "it keeps about one block's worth, at ~33% more compute)")
    if act > 0 and cfg.train.micro_batch_size > 1:
        room = usable - (p.peak_bytes - act)
        b = int(cfg.train.micro_batch_size * room / act) if room > 0 else 0
        if b >= 1:
            ch.append(f"a smaller micro batch: train.micro_batch_size={min(b, cfg.train.micro_batch_size - 1)} "
                      "(activations scale linearly; keep global_batch_size by accumulation)")
    if cfg.train.precision == "fp32" and cfg.parallel.mixed_precision == "fp32":
        if gpu.bf16:
            ch.append("bf16: train.precision=bf16 parallel.mixed_precision=bf16 (about halves activations and "
                      "gathered parameters; shards, gradients and Adam state stay fp32)")
        else:
            ch.append(f"{gpu.name} has no bf16: train.precision=fp16 parallel.mixed_precision=fp16 with loss "
                      "scaling (about halves activations and gathered parameters)")
    return out


# -- the command -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpu", required=True, choices=list(GPUS), help="the GPU each rank runs on")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks (GPUs) per node")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (world size = N x K)")
    p.add_argument("--interconnect", default=None, choices=list(INTERCONNECTS),
                   help="link between ranks for the time prediction (default: nvlink on one node, "
                        "infiniband-400 across nodes)")
    p.add_argument("--engines", default=None, help="comma-separated engines (default: all that apply)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args) -> int:
    from shardlab.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.nproc < 1 or args.nodes < 1:
            raise ConfigError(f"--nproc and --nodes must be >= 1, got {args.nproc} and {args.nodes}")
        engines = args.engines.split(",") if args.engines else None
        if engines:
            bad = [e for e in engines if e not in ENGINES]
            if bad:
                raise ConfigError(f"--engines: unknown {', '.join(bad)}; valid: {', '.join(ENGINES)}")
        world = args.nproc * args.nodes
        preds = predict_all(cfg, world, engines, per_node=args.nproc)  # validates every engine before probing
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = GPUS[args.gpu]
    link = INTERCONNECTS[args.interconnect or ("nvlink" if args.nodes == 1 else "infiniband-400")]
    report: dict[str, Any] = {"gpu": dataclasses.asdict(gpu), "usable_bytes": usable_bytes(gpu), "world": world,
                              "nodes": args.nodes, "interconnect": dataclasses.asdict(link), "mfu": MFU,
                              "engines": {}}
    for e, p in preds.items():
        c = engine_config(cfg, e, world, args.nproc)
        v = verdict(c, p, gpu, preds, world)
        ts = step_time(c, e, world, link, gpu, None, args.nodes)
        ts["comm_stops_hiding_at_nodes"] = hiding_limit(c, e, args.nproc, link, ts["compute_s"])
        report["engines"][e] = {**p.to_dict(), "verdict": v, "time": ts}
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    print_report(cfg, report)
    return 0


_UNIT = [2**30, "GiB"]


def _gib(b: float) -> str:
    return f"{b / _UNIT[0]:.2f}"


def print_report(cfg, report: dict[str, Any]) -> None:
    gpu = report["gpu"]
    print(f"shardlab plan: {cfg.model.name} ({_param_count(cfg) / 1e6:.1f} M parameters), micro batch "
          f"{cfg.train.micro_batch_size} x {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, "
          f"{report['world']} rank(s) = {report['world'] // report['nodes']} x {report['nodes']} node(s) of "
          f"{gpu['name']} ({gpu['memory_bytes'] / 1e9:.0f} GB, usable {_gib(report['usable_bytes'])} GiB)")
    small = max(r["peak_bytes"] for r in report["engines"].values()) < 2**30
    _UNIT[:] = [2**20, "MiB"] if small else [2**30, "GiB"]
    print(f"predicted peak per rank, {_UNIT[1]}, by part:")
    cols = ["params", "gathered_params", "grads", "unsharded_grads", "optimizer", "activations", "comm"]
    head = f"{'engine':11s} {'peak':>7s} " + " ".join(f"{c[:10]:>10s}" for c in cols) + "  verdict"
    print(head)
    for e, r in report["engines"].items():
        v = r["verdict"]
        word = (f"fits, {_gib(v['margin_bytes'])} {_UNIT[1]} spare" if v["fits"] else
                ("does not fit" if r["probed"] else "does not fit (lower bound)" if v["margin_bytes"] < 0
                 else "unknown (not probed)"))
        print(f"{e:11s} {_gib(r['peak_bytes']):>7s} " + " ".join(f"{_gib(r['parts'][c]):>10s}" for c in cols)
              + f"  {word}")
    for e, r in report["engines"].items():
        for n in r["notes"]:
            print(f"  {e}: {n}")
        for c in r["verdict"]["changes"]:
            print(f"  {e}: change: {c}")
    print(f"time per step on {report['interconnect']['name']} (alpha {report['interconnect']['alpha_s'] * 1e6:.0f} us, "
          f"{report['interconnect']['bandwidth'] / 1e9:.1f} GB/s), compute at MFU {report['mfu']:g}:")
    for e, r in report["engines"].items():
        t = r["time"]
        lim = t["comm_stops_hiding_at_nodes"]
        print(f"  {e:11s} compute {t['compute_s'] * 1e3:9.1f} ms  comm {t['comm_s'] * 1e3:9.1f} ms  step "
              f"{t['step_s'] * 1e3:9.1f} ms  {t['tokens_per_s'] or 0:12.0f} tokens/s  comm "
              f"{'hidden' if t['comm_hidden'] else 'EXPOSED'}"
              + (f"; stops hiding at {lim} node(s)" if lim else "; hidden up to 1024 nodes"))


# -- fitting the loopback link ----------------------------------------------------------------------------
FIT_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)   # bytes of the full buffer
FIT_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _time_collectives(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> list[tuple[str, int, float]]:
    import torch
    import torch.distributed as dist

    from shardlab.engines import collectives as c

    out = []
    for nbytes in sizes:
        n = nbytes // 4
        full = torch.ones(n - n % world)
        shard = torch.ones(full.numel() // world)
        # the engines' own collectives (on CPU: [Note: flat collectives on CPU, without gloo's temporaries])
        ops = {"all_reduce": lambda f=full: c.all_reduce(f),
               "all_gather": lambda f=full, s=shard: c.all_gather_into(f, s),
               "reduce_scatter": lambda f=full, s=shard: c.reduce_scatter_into(s, f, average=False),
               "broadcast": lambda f=full: c.broadcast(f, 0),
               "reduce": lambda f=full: c.reduce(f, 0)}
        for kind, op in ops.items():
            op()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            out.append((kind, full.numel() * 4, sorted(times)[len(times) // 2]))
    return out


def measure_collectives(world: int, sizes: tuple[int, ...] = FIT_SIZES, repeats: int = 5) -> list[tuple[str, int, float]]:
    """Median seconds of each collective kind and size on `world` local gloo workers (rank 0's clock)."""
    from shardlab.testing import run_workers

    return run_workers(world, _time_collectives, sizes, repeats, timeout_s=600)[0]


def fit_per_kind(samples: list[tuple[str, int, float]], world: int) -> tuple[tuple[str, float, float], ...]:
    """fit_alpha_beta for each collective kind on its own: ((kind, alpha_s, bandwidth), ...)."""
    kinds = sorted({k for k, _, _ in samples})
    return tuple((k, *fit_alpha_beta([x for x in samples if x[0] == k], world)) for k in kinds)


def fit_alpha_beta(samples: list[tuple[str, int, float]], world: int) -> tuple[float, float]:
    """Least squares of t = alpha * steps + bus_bytes / bandwidth over every kind and size, with
    the ring model of `collective_time`; returns (alpha_s, bandwidth)."""
    import numpy as np

    unit = Link("unit", 1.0, 1.0, "")
    rows, ts = [], []
    for kind, nbytes, t in samples:
        steps = collective_time(kind, 0, world, unit)            # alpha coefficient
        bus = collective_time(kind, nbytes, world, Link("b", 0.0, 1.0, ""))  # bytes on the bus
        rows.append([steps / t, bus / t])                        # relative errors: divide by t
        ts.append(1.0)
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows), np.array(ts), rcond=None)
    return float(alpha), float(1.0 / inv_bw)


def main(argv: list[str] | None = None) -> int:
    """python -m shardlab.plan fit-loopback: fit loopback's alpha-beta at 2 workers, check at 4."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["fit-loopback"]:
        print("usage: python -m shardlab.plan fit-loopback [--check-world 4]", file=sys.stderr)
        return 2
    check = int(argv[argv.index("--check-world") + 1]) if "--check-world" in argv else 4
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 15
    s2 = measure_collectives(2, repeats=repeats)
    alpha, bw = fit_alpha_beta(s2, 2)
    one = Link("loopback-fit", alpha, bw, "fit")
    per_kind = fit_per_kind(s2, 2)
    each = Link("loopback-fit-per-kind", alpha, bw, "fit", per_kind)
    print(f"fit at 2 workers, one pair: alpha = {alpha * 1e6:.1f} us, bandwidth = {bw / 1e9:.3f} GB/s")
    for k, a, b in per_kind:
        print(f"fit at 2 workers, {k}: alpha = {a * 1e6:.1f} us, bandwidth = {b / 1e9:.3f} GB/s")
    s_check = measure_collectives(check, repeats=repeats)
    for label, samples, w in (("2 workers (fit)", s2, 2), (f"{check} workers (check)", s_check, check)):
        print(f"{label}: kind, bytes, measured ms, predicted ms (one pair / per kind), error (one pair / per kind)")
        errs: dict[str, list[float]] = {"one": [], "each": []}
        for kind, nbytes, t in samples:
            p1, p2 = collective_time(kind, nbytes, w, one), collective_time(kind, nbytes, w, each)
            errs["one"].append(abs(p1 - t) / t)
            errs["each"].append(abs(p2 - t) / t)
            print(f"  {kind:15s} {nbytes:10d} {t * 1e3:9.3f} {p1 * 1e3:9.3f} {p2 * 1e3:9.3f} "
                  f"{100 * (p1 - t) / t:+6.1f}% {100 * (p2 - t) / t:+6.1f}%")
        for name, e in errs.items():
            e.sort()
            print(f"  {'one pair' if name == 'one' else 'per kind'}: mean |error| {100 * sum(e) / len(e):.1f}%, "
                  f"median {100 * e[len(e) // 2]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
