"""Shared pieces of the checkpoint tests: a tiny run config, training through the real loop
with a simulated crash after step K's checkpoint, and bitwise comparison of checkpoints."""

from __future__ import annotations

import torch

from shardlab.checkpoint import CheckpointManager, read_tensors
from shardlab.config import engine_options, load_config
from shardlab.loop import run as R
from shardlab.loop import train as T
from shardlab.loop.runtime import Runtime
from shardlab.loop.schedule import make_optimizer, make_schedule
from shardlab.models import build_model

K = 3          # steps before the interruption
TOTAL = 2 * K  # steps of the whole run


class SimulatedCrash(Exception):
    """Raised right after the checkpoint of step K: the run dies there."""


def overrides(strategy: str, out: str, name: str, *extra: str, steps: int = TOTAL, every: int = K) -> list[str]:
    """The tiny run's key=value overrides (for load_config, or a `shardlab train` command line)."""
    # dropout > 0: the RNG states must be restored too for the losses to match bitwise
    return [
        f"parallel.strategy={strategy}", "model.preset=gpt-nano", "model.dropout=0.1",
        "data.source=synthetic", "data.seq_len=16", "data.synthetic_samples=256",
        f"train.steps={steps}", "train.global_batch_size=12", "train.micro_batch_size=2", "train.warmup_steps=1",
        "train.lr=0.01", "train.eval_batches=1", f"checkpoint.every_steps={every}", "checkpoint.keep_last=3",
        f"output.dir={out}", f"output.run_name={name}", "output.tensorboard=false", "output.progress=false",
        "parallel.timeout_s=60", *extra]


def make_cfg(strategy: str, out: str, name: str, *extra: str, steps: int = TOTAL, every: int = K):
    return load_config(None, overrides(strategy, out, name, *extra, steps=steps, every=every))


def runtime(rank: int, world: int, strategy: str) -> Runtime:
    backend = None if strategy == "single" and world == 1 else "gloo"
    return Runtime(rank, rank, world, torch.device("cpu"), backend)


def train_until_crash(cfg, rt, crash_after: int = K) -> None:
    """Train with cfg, dying (SimulatedCrash) right after the checkpoint of step crash_after."""
    original = CheckpointManager.maybe_save

    def save_then_crash(self, model, opt, sched, state):
        path = original(self, model, opt, sched, state)
        if state.step == crash_after:
            self.wait()
            raise SimulatedCrash()
        return path

    CheckpointManager.maybe_save = save_then_crash
    try:
        T.train(cfg, rt)
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("the run was expected to crash")
    finally:
        CheckpointManager.maybe_save = original


def straight_and_resumed(rank: int, world: int, strategy: str, out: str, *extra: str, tag: str = "") -> dict:
    """Train TOTAL steps straight, and K steps + crash + resume to TOTAL; return both results.
    Run directories: <out>/<strategy><tag>-straight and -resumed."""
    rt = runtime(rank, world, strategy)
    a = T.train(make_cfg(strategy, out, f"{strategy}{tag}-straight", *extra), rt)
    train_until_crash(make_cfg(strategy, out, f"{strategy}{tag}-resumed", *extra), rt)
    b = T.train(make_cfg(strategy, out, f"{strategy}{tag}-resumed", *extra), rt)
    return {"straight": a["losses"], "resumed": b["losses"], "steps_this_run": b["steps_this_run"]}


def in_float64() -> None:
    """This process's runs build their model in float64, as `shardlab verify`'s float64 runs do
    (build_run's adapt_model: the engines materialize the meta model in its dtype), so that two
    runs that sum the same samples in another grouping differ by float64 rounding only
    (tests/parity.py's [Note: why the harness runs in float64]). For spawned workers."""
    build = R.build_run
    if getattr(build, "float64", False):
        return

    def build_run(cfg, rt, **kw):
        return build(cfg, rt, adapt_model=lambda model: model.to(torch.float64), **kw)

    build_run.float64 = True
    R.build_run = build_run


class SampleLog:
    """What the loop's micro batches hold, as the loader fetched them: step -> this rank's
    (source, index) sample ids in order (source 0 but for a mixture's corpora). For spawned workers."""

    def __init__(self):
        from shardlab.data.loader import StepBatches, StepBatchSampler

        self.steps: dict[int, list[tuple[int, int]]] = {}
        pending: list[list[int]] = []  # index lists the DataLoader took, in order (it returns batches in order)
        start, batches, indices = StepBatches._start, StepBatches.next, StepBatchSampler.__iter__

        def iterate(sampler):
            for idx in indices(sampler):
                pending.append(idx)
                yield idx

        def restart(loader, step):
            pending.clear()  # what an abandoned loader took ahead is never returned
            start(loader, step)

        def next_batch(loader, step):
            out = batches(loader, step)
            ds = loader.dataset
            ids = [(ds.source_of(i), i - ds.offsets[ds.source_of(i)]) if hasattr(ds, "source_of") else (0, i)
                   for i in pending.pop(0)]
            self.steps.setdefault(step, []).extend(ids)
            return out

        StepBatchSampler.__iter__, StepBatches._start, StepBatches.next = iterate, restart, next_batch

    def take(self) -> dict[int, list[tuple[int, int]]]:
        out, self.steps = self.steps, {}
        return out


def global_ids(per_rank: list[dict[int, list]], steps) -> dict[int, list]:
    """The global batch of each step: the ranks' sample ids in rank order (rank r reads the r-th slice)."""
    return {s: [i for r in per_rank for i in r[s]] for s in steps}


def assert_same_tensors(path_a: str, path_b: str, prefixes=("model/", "optim/")) -> int:
    """Bitwise equality of the model and optimizer tensors of two checkpoints; returns the count."""
    n = 0
    for prefix in prefixes:
        a, b = read_tensors(path_a, prefix), read_tensors(path_b, prefix)
        assert a.keys() == b.keys(), (prefix, sorted(set(a) ^ set(b))[:5])
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} differs between {path_a} and {path_b}"
        n += len(a)
    return n


def load_and_resave(rank: int, world: int, strategy: str, source: str, dest_root: str, out: str,
                    extra: tuple[str, ...] = ()) -> str:
    """Build `strategy` at this world size (with config overrides `extra`, through the training
    loop's own option flow), load checkpoint `source` into it, save it again."""
    import shardlab

    cfg = make_cfg(strategy, out, "unused", *extra)
    rt = runtime(rank, world, strategy)
    model = shardlab.parallelize(build_model(cfg.model, seed=cfg.seed, vocab_size=256, device="meta"), strategy,
                                 device="cpu", **engine_options(cfg.parallel))
    opt = make_optimizer(cfg.train, model.parameters())
    sched = make_schedule(cfg.train, opt)
    state = R.TrainState()
    manager = CheckpointManager(dest_root, rt, config=cfg)
    manager.load(source, model, opt, sched, state)
    return manager.save(model, opt, sched, state)
