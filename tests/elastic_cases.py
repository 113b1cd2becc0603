"""Elastic and exact on every engine, cheaply: each (engine, data) case trains at 4 ranks, stops right
after step 2's checkpoint as a membership change stops a group (loop/elastic.py), resumes at 2 ranks
(a node lost), stops after step 4, and finishes at 3 (a node joined); global batch 12, micro batch
1: accumulation 3 -> 6 -> 4. Its per-step losses equal an uninterrupted one-process run's to 1e-10
relative in float64, on the built-in corpus and on a corpus `shardlab prepare` wrote.
tests/test_elastic_agents.py shows the same with real agents for ddp; here the phases run inside
test_checkpoint_dist.py's spawns (one per world size: process start-up is most of a spawn's cost),
through the same loop and checkpoints."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from shardlab.loop import run as R
from shardlab.loop import train as T
from tests.checkpoint_helpers import overrides, runtime, train_until_crash
from tests.parity import F64_ATOL, F64_RTOL

ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
KINDS = ("builtin", "tokens")
STOP = {4: 2, 2: 4, 3: None}   # world size -> the step after whose checkpoint its group stops (None: the end)
STEPS = 6
# no dropout: each world size would draw other masks
COMMON = ("model.dropout=0.0", "train.micro_batch_size=1", f"train.steps={STEPS}")


def _cfg(strategy: str, kind: str, out: str, corpus: str):
    from shardlab.config import load_config

    data = ["data.source=builtin"] if kind == "builtin" else ["data.source=tokens", f"data.path={corpus}"]
    return load_config(None, [*overrides(strategy, out, f"elastic-{strategy}-{kind}", steps=STEPS, every=2),
                              *COMMON, *data])


@contextlib.contextmanager
def _float64():
    """Runs built in float64 (as checkpoint_helpers.in_float64), undone after: the spawn's other cases stay as they were."""
    build = R.build_run
    R.build_run = lambda cfg, rt, **kw: build(cfg, rt, adapt_model=lambda m: m.to(torch.float64), **kw)
    try:
        yield
    finally:
        R.build_run = build


def phase(rank: int, world: int, out: str, corpus: str) -> dict:
    """Every case at this world size, from its latest checkpoint to STOP[world]; the finished
    runs' losses (after the last phase)."""
    done = {}
    with _float64():
        for strategy in ENGINES:
            for kind in KINDS:
                cfg, rt = _cfg(strategy, kind, out, corpus), runtime(rank, world, strategy)
                if STOP[world] is None:
                    done[(strategy, kind)] = T.train(cfg, rt)["losses"]
                else:
                    train_until_crash(cfg, rt, crash_after=STOP[world])
    return done


def prepare_corpus(tmp) -> str:
    """A byte-level corpus prepared by `shardlab prepare`."""
    from shardlab import cli
    from tests.test_prepare import DOCS, as_text_files

    assert cli.main(["prepare", as_text_files(tmp, DOCS), "--out", str(tmp / "data")]) == 0
    return str(tmp / "data")


def reference(out: str, corpus: str) -> dict[str, list[float]]:
    """The uninterrupted runs, one process per data kind, float64 (equal to any world size's to ~1e-16:
    tests/parity.py)."""
    with _float64():
        return {kind: T.train(_cfg("single", kind, out, corpus), runtime(0, 1, "single"))["losses"] for kind in KINDS}


def check(losses: list[float], reference: list[float], out: str, strategy: str, kind: str) -> None:
    assert len(losses) == len(reference) == STEPS
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64),
                               rtol=F64_RTOL, atol=F64_ATOL)
    with open(os.path.join(out, f"elastic-{strategy}-{kind}", "run_args.json")) as f:
        args = json.load(f)
    # the last start: 3 ranks, accumulation 12 / (3 x 1), from the step 2 ranks trained to
    assert (args["world_size"], args["accumulation_steps"], args["resumed_from_step"]) == (3, 4, STOP[2])
