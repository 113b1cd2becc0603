"""The probes: each engine runs a real training step on CPU, in a child process, on a fake
process group of N ranks (collectives return at once; the memory they use is allocated as in a
real run), on the model cut to `PROBE_LAYERS` blocks, measured by the live-memory tracker
(shardlab.memory). The engine's real code runs, so its bounds (how many units are gathered, how
many gradients are in flight) are measured, not assumed. Two figures per probe: the step's peak
and the forward peak, each with its breakdown by part, and the breakdown at the end of each (what
the scaling in depth grows by: plan/scaling.py).

Two kinds of probe ([Note: fake-tensor probes]):
- "fake" (every engine that can, `Engine.fake_tensor_probe`): the step runs under torch's
  `FakeTensorMode`: every tensor has its real shape, dtype and size but no data (a meta storage),
  so a probe at the real width, micro batch and sequence length costs seconds and megabytes.
- "real": real tensors at a micro batch of at most `PROBE_TOKENS` tokens, activations scaled up
  from there; for an engine that cannot run on fake tensors (or `--probe real`), and then on a
  real one-rank gloo group where it cannot run on real tensors on a fake group
  (`Engine.fake_group_probe` False: the future of PyTorch DDP's all-reduce hook needs a real group).
PyTorch's DDP (torch-ddp) runs its own step on fake tensors too, its C++ reducer allocating its
buckets as fake storages, with three values answered for it (plan/fake_ddp.py, [Note: PyTorch DDP
on fake tensors]).

[Note: fake-tensor probes]
Under FakeTensorMode an operator computes only its outputs' metadata; each output gets a meta
storage of the size the real one would have, created and freed when the real one would be
(checked: identity stable, weakref callbacks on the last reference, `resize_` as on real
storages). The live-memory tracker counts those storages (`fake=True`) exactly as it counts real
ones, so what it reports is what the same step allocates on real tensors: the fake-vs-real test
checks it to the byte on small models. Three things a step does that fake tensors cannot:
reading a value as a Python number (the logged loss, AdamW's step count, token counts):
`_ScalarReads` answers 1 (a step count from 1, a non-zero count of target tokens); the fp16
loss scaler, whose found-inf flag decides whether the optimizer steps, is left out of a fake
probe (its memory is a few scalars: it scales the loss and unscales the gradients in place);
the data pipeline (numpy
permutations, a DataLoader), which runs outside the fake mode on real tensors, as the batches
enter the step converted; and the model built on the meta device, which stays plain meta until
the engine materializes it (models.build_model).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

import shardlab
from shardlab import memory
from shardlab.config import Config, TrainConfig, config_from_dict
from shardlab.data import build_datasets, collate
from shardlab.engines import engine_class
from shardlab.loop.runtime import Runtime
from shardlab.models import MODELS
from shardlab.plan.fake_ddp import ddp_on_fake_tensors
from shardlab.plan.model import cut_depth, init_fake_group, vocab_size
from shardlab.plan.ops import OpCensus

#: Blocks of the model the probes run with (GPT's n_layer, an HF decoder's num_hidden_layers;
#: other models run whole).
PROBE_LAYERS = (3, 4)
#: A model of at most this many blocks is probed whole on fake tensors (nothing is scaled in depth);
#: a deeper one at PROBE_LAYERS, its fake step's time growing with depth.
FAKE_WHOLE_DEPTH = 8
#: Tokens (micro batch x sequence) a probe micro batch holds at most; activations scale from there.
PROBE_TOKENS = 256
#: A probe whose model state would exceed this is not run (the engine is then reported by its model state
#: only); SHARDLAB_PLAN_PROBE_MAX_GIB raises it on a machine with more memory to spare.
PROBE_MAX_BYTES = int(float(os.environ.get("SHARDLAB_PLAN_PROBE_MAX_GIB", "6")) * 2**30)
#: Seconds the probes of all engines may take together; past it the engines are reported by their
#: model state only. SHARDLAB_PLAN_PROBE_TIMEOUT_S changes it (a large model on a few CPU cores).
PROBE_TIMEOUT_S = float(os.environ.get("SHARDLAB_PLAN_PROBE_TIMEOUT_S", "1800"))


def probe_layers(t: TrainConfig, depth: int | None) -> list[int | None]:
    """The depths the probes run at: PROBE_LAYERS, or with train.ac_every=K (checkpointing every K-th
    block) two depths K apart, so that the blocks added between them hold the mix of checkpointed and
    plain blocks the real model has (the scaling takes the mean per block). None: the model runs whole."""
    if depth is None:
        return [None]
    lo, hi = PROBE_LAYERS
    if t.activation_checkpointing != "none" and t.ac_every > 1:
        hi = lo + t.ac_every
    return sorted({min(lo, depth), min(hi, depth)})


def probe_shape(cfg: Config, fake: bool = False) -> tuple[int, int, float]:
    """(micro batch, seq) the probe runs at and the factor activations scale by: a fake probe
    runs at the real shape; a real one at most `PROBE_TOKENS` tokens."""
    b, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    if fake:
        return b, seq, 1.0
    pb, ps = b, seq
    while pb * ps > PROBE_TOKENS and pb > 1:
        pb = max(1, pb // 2)
    while pb * ps > PROBE_TOKENS and ps > 16:
        ps = max(16, ps // 2)
    return pb, ps, (b * seq) / (pb * ps)


def probe_config(cfg: Config, n_layer: int | None, micro: int, seq: int, world: int, steps: int, accumulation: int,
                 tmpdir: str):
    raw = cfg.to_dict()
    if n_layer is not None:
        cut_depth(raw, n_layer, tmpdir)
    raw["data"]["seq_len"] = seq
    # Eager, with the config's activation checkpointing (train.activation_checkpointing, ac_every): the live
    # tracker cannot see compiled kernels, and dynamo would not run them under it anyway (docs/memory.md);
    # predict.py says so in the prediction's notes.
    raw["train"].update(micro_batch_size=micro, global_batch_size=micro * world * accumulation, steps=steps,
                        memory_tracking="none", eval_every=0, profile=False, compile=False, compile_mode=None)
    key = MODELS[cfg.model.name].vocab_key
    if key is not None:  # the probe's data: synthetic tokens with the real vocabulary
        raw["model"][key] = vocab_size(cfg)
    # synthetic tokens of the same shape: memory does not depend on their values; SFT's packing
    # changes only which tokens attend to which (a mask of the same size), so it is dropped here
    raw["data"].update(source="synthetic", path=None, tokenizer=None, tokenizer_path=None, packing=False,
                       synthetic_samples=max(64, 4 * micro * world))
    raw["checkpoint"].update(every_steps=0, resume="none")
    raw["output"].update(tensorboard=False, trackers=None, progress=False, run_name="plan-probe")
    return config_from_dict(raw)


def probe_child(plans: dict[str, dict], nproc: int, layers: list[int | None], accumulation: int) -> dict:
    """Run each engine for real on a fake N-rank group at each probe depth: an untracked step
    (creates optimizer state), a tracked step (the peak) and a step whose forward alone is
    tracked (the forward peak). plans: {engine: {"raw": its config (engine_config), "fake": probe
    on fake tensors, "micro": , "seq": }}. Returns {engine: {layers: {...}}}. A real-tensor probe
    of an engine without `fake_group_probe` runs last, on a real one-rank group."""
    torch.set_num_threads(1)
    out: dict = {}
    init_fake_group(0, nproc)
    rt = Runtime(0, 0, nproc, torch.device("cpu"), "fake")
    tmp = tempfile.TemporaryDirectory(prefix="shardlab-plan-")
    def needs_real_group(engine: str) -> bool:
        return not plans[engine]["fake"] and not engine_class(engine).fake_group_probe

    for engine in sorted(plans, key=needs_real_group):
        plan = plans[engine]
        cfg0 = config_from_dict(plan["raw"])
        if needs_real_group(engine) and rt.backend == "fake":
            # a real one-rank gloo group (a FileStore, no network): exact for a replica, whose
            # memory does not depend on N
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.FileStore(f"{tmp.name}/store", 1), rank=0, world_size=1)
            rt = Runtime(0, 0, 1, torch.device("cpu"), "gloo")
        out[engine] = {str(L): _probe_once(probe_config(cfg0, L, plan["micro"], plan["seq"], rt.world_size, 3,
                                                        accumulation, tmp.name), rt, plan["fake"])
                       for L in plan.get("layers", layers)}
    dist.destroy_process_group()
    tmp.cleanup()
    return out


class _ScalarReads(TorchDispatchMode):
    """Under FakeTensorMode, a value read from a fake tensor as a Python number is 1 ([Note:
    fake-tensor probes]). A real tensor's value is its own: FSDP2 reads its rank's coordinate in
    the device mesh from a real host tensor (`unset_fake_temporarily` in models/init.py), and a 1
    there put rank 0's shard at row offset 1 x shard (at one rank, past the end)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1.0 if args[0].dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is a FakeTensor: real shapes and sizes, no data."""
    with FakeTensorMode(allow_non_fake_inputs=True), _ScalarReads(), _transformers_not_tracing(), \
            ddp_on_fake_tensors():
        yield


@contextlib.contextmanager
def _transformers_not_tracing():
    """transformers counts a FakeTensor as tracing (`is_tracing`) and then builds a B x 1 x T x T
    causal mask and expands grouped K/V heads, where a real run passes `is_causal=True`: 48 KiB
    more on mistral-tiny at micro batch 2 x 32. Told it is not tracing, it reads the values it
    would read (no padding: `_ScalarReads`) and takes the real run's path."""
    try:  # deferred: transformers is optional (the hf extra), and heavy
        from transformers.utils import import_utils as utils
    except ImportError:
        utils = None
    if utils is None or not hasattr(utils, "is_fake_tensor"):
        yield
        return
    original = utils.is_fake_tensor
    utils.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        utils.is_fake_tensor = original


class _HostBatches:
    """A run's batches drawn outside the fake mode (the sampler's numpy permutation and the
    DataLoader need real tensors); the step converts them to fake tensors as they enter it."""

    def __init__(self, inner):
        self.inner = inner

    def next(self, step: int):
        with unset_fake_temporarily():
            return self.inner.next(step)


def _probe_once(cfg: Config, rt, fake: bool) -> dict:
    """One engine at one depth: the tracked step's peak and breakdown, its end's (what stays between
    steps), the forward peak's and the forward's end's (what every block keeps for backward)."""
    # deferred: shardlab.loop.train costs about 1 s to import (torch.distributed.checkpoint and the
    # loop's dependencies); the probes run in a child, and `shardlab --help` need not pay it
    from shardlab.loop.run import build_run
    from shardlab.loop.train import train_step

    data = build_datasets(cfg)  # real tensors, outside any fake mode
    with fake_tensors() if fake else contextlib.nullcontext():
        run = build_run(cfg, rt, data=data)
        if fake:
            run.batches = _HostBatches(run.batches)
            run.scaler = None  # its found-inf flag is a value: see the Note
        run.model.train()
        train_step(run)
        run.opt.zero_grad(set_to_none=True)
        run.state.step += 1
        tracker = memory.LiveMemoryTracker(rt.device, engine=run.engine, optimizer=run.opt, fake=fake)
        t0 = time.perf_counter()
        with tracker.step(1), OpCensus() as counted:
            train_step(run, tracker)
        seconds = time.perf_counter() - t0
        full = tracker.summary()
        tracker.close()
        run.opt.zero_grad(set_to_none=True)
        run.state.step += 1
        # the forward peak: only the forward of the last micro batch (after the no_sync ones) is tracked
        fwd = _forward_peak(run, rt, fake)
    return {"peak": full["peak_live_bytes"], "parts": full["parts"], "phase": full["phase"],
            "fwd_peak": fwd["peak_live_bytes"], "fwd_parts": fwd["parts"],
            "end_parts": (full["step_end"] or {}).get("parts", {}),
            "fwd_end_parts": (fwd["step_end"] or {}).get("parts", {}), "step_seconds": seconds, "fake": fake,
            "step_flops": counted.flops, "census": counted.census}


def _forward_peak(run, rt, fake: bool) -> dict:
    from shardlab.loop.loss import autocast  # deferred: only this forward needs the loop's precision

    t = run.cfg.train
    with unset_fake_temporarily():
        idx = run.sampler.rank_indices(run.state.step, rt.rank, rt.world_size)
        batches = [collate(run.data.train, idx[i * t.micro_batch_size:(i + 1) * t.micro_batch_size])
                   for i in range(run.accumulation)]
    for i, (x, y) in enumerate(batches):
        last = i == run.accumulation - 1
        with contextlib.nullcontext() if last else shardlab.no_sync(run.model):
            if last:
                tracker = memory.LiveMemoryTracker(rt.device, engine=run.engine, optimizer=run.opt, fake=fake)
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
