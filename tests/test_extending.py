"""Every engine answers what the tools ask of it (engines/planning.py, engines/measuring.py), and an engine and a model added
from outside src/ with one class and one registry line each (tests/toys.py) go through
`train`, `plan` and `bench` like the built-in ones (docs/architecture.md, "Extending shardlab").

One spawn trains the toy at N=2 beside ddp; plan probes it in its child; bench runs one cell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import shardlab
import tests.toys  # noqa: F401  (registers "toy" in STRATEGIES and MODELS)
from shardlab.engines import STRATEGIES, EngineEntry, engine_class
from shardlab.engines.api import Engine
from shardlab.engines.measuring import Measurable
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable
from shardlab.memory import PARTS, LiveMemoryTracker
from shardlab.testing import run_workers
from tests.toys import ToyNet

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_class_answers(name: str) -> None:
    cls = engine_class(name)
    assert issubclass(cls, Plannable) and issubclass(cls, Measurable), name
    assert isinstance(cls.grads_sharded, bool) and isinstance(cls.distributed, bool)
    assert isinstance(cls.fake_group_probe, bool) and all(isinstance(o, str) for o in cls.options)
    with torch.device("meta"):
        params = list(ToyNet().parameters())
    planned = cls.planned_state(params, 2, {})
    if planned is None:
        assert set(cls.planned_ranks(2)) <= {0, 1} and cls.planned_ranks(2), name
    else:
        assert planned and all(isinstance(t, LocalTensor) for rank in planned for t in rank), name
    traffic = ModelTraffic(param_bytes=4000.0, trainable_bytes=4000.0, root_bytes=1000.0, units=2,
                           micro_batches=1, world=2, tensors=6, trainable_tensors=6)
    sent = cls.step_traffic(traffic, {})
    assert all(isinstance(c, Collective) and c.kind in KINDS and c.calls >= 1 and c.ranks >= 1 for c in sent), name
    assert bool(sent) == cls.distributed, (name, sent)


def _check_built_answers(name: str) -> None:
    """Built at world 1, after one training step: what it holds, what it counted, its ranks' state."""
    model = shardlab.parallelize(ToyNet(), name, device="cpu")
    engine = shardlab.engine_of(model)
    assert engine.strategy == name
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = LiveMemoryTracker("cpu", engine=engine, optimizer=opt)  # calls hook_memory_tracker
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    with tracker.step(0):
        model(x, y).backward()
        opt.step()
    held = list(engine.memory_buffers())
    assert all(part in PARTS and isinstance(t, torch.Tensor) for part, t in held), (name, held)
    assert tracker.summary()["peak_live_bytes"] > 0
    tracker.close()
    states = engine.rank_states()
    assert states and all(isinstance(t, LocalTensor) for rank in states for t in rank), name
    counted = engine.comm_stats()
    assert (counted is None) == (not engine.comm_counters()), name
    assert counted is None or set(counted) <= set(KINDS), (name, counted)


def test_the_training_contract_stays_small():
    """`Engine` holds what the training loop calls, at most 10 public members of its own (methods
    and class attributes); plan's questions are `Plannable`'s, the measurements' `Measurable`'s
    (docs/architecture.md, "The engine contract"). A class composing only Engine is refused by name."""
    own = sorted(n for n in {*vars(Engine), *Engine.__annotations__} if not n.startswith("_"))
    assert len(own) <= 10, own
    assert not set(own) & ({*vars(Plannable), *vars(Measurable)}), own
    STRATEGIES["engine-alone"] = EngineEntry("shardlab.engines.api:Engine")
    try:
        with pytest.raises(TypeError, match="must be a class composing Engine, Plannable and Measurable"):
            engine_class("engine-alone")
    finally:
        del STRATEGIES["engine-alone"]


def test_every_engine_answers_what_the_tools_ask(tmp_path):
    """For every registered engine (the toy too): the class attributes plan, bench and config read;
    its exact state rule (or the ranks to build it at); its collectives per step; and, built,
    its transient buffers by part, its gradient hooks for the tracker, its counters."""
    assert "toy" in STRATEGIES
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for name in STRATEGIES:
            _check_class_answers(name)
            _check_built_answers(name)
    finally:
        dist.destroy_process_group()


def _write_config(tmp_path) -> str:
    path = tmp_path / "toy.yaml"
    path.write_text("model: {name: toy}\n"
                    "data: {source: synthetic, synthetic_samples: 64}\n"
                    "train: {steps: 3, global_batch_size: 8, micro_batch_size: 4, eval_batches: 1, warmup_steps: 0}\n"
                    "parallel: {strategy: toy}\n"
                    "checkpoint: {resume: none}\n"
                    f"output: {{dir: {tmp_path / 'runs'}, tensorboard: false, progress: false}}\n")
    return str(path)


def _train_toy_and_ddp(rank: int, world: int, config: str) -> dict:
    from shardlab.config import load_config
    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train

    out = {}
    for strategy in ("toy", "ddp"):
        cfg = load_config(config, [f"parallel.strategy={strategy}", f"output.run_name={strategy}"])
        result = train(cfg, Runtime(rank, rank, world, torch.device("cpu"), "gloo"))
        out[strategy] = {"losses": result["losses"], "comm": result["comm_bytes"][rank]}
    return out


@pytest.mark.slow
def test_toy_engine_and_model_go_through_train_plan_and_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_PLUGINS", "tests.toys")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    config = _write_config(tmp_path)
    psi = sum(p.numel() for p in ToyNet().parameters())

    # train: at N=2 the toy averages gradients as ddp does: the same losses (both divide by N
    # before one sum of two fp32 values, so they agree to the bit; 1e-6 leaves room for another
    # summation order), and one all-reduce of all the gradients per step
    runs = run_workers(2, _train_toy_and_ddp, config, timeout_s=180)
    for r in runs:
        assert r["toy"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-6), r
        assert r["toy"]["comm"]["all_reduce"]["calls"] == 3
        assert r["toy"]["comm"]["all_reduce"]["payload_bytes"] == 3 * 4 * psi

    # plan: probed on a fake group like the built-in engines, its state and traffic its own answers
    from shardlab.cli import main

    assert main(["plan", config, "--gpu", "T4", "--nproc", "2", "--engines", "toy,ddp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["engines"]
    assert report["toy"]["probed"] and report["toy"]["peak_bytes"] > 0
    assert report["toy"]["model_state"] == report["ddp"]["model_state"]  # both hold everything whole
    assert report["toy"]["time"]["comm_s"] > 0

    # bench: one cell through the real `shardlab train --nproc 2`, its traffic the theory's exactly
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "shardlab", "bench", config, "--strategies", "toy", "--nproc", "2",
                           "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["strategy"] == "toy" and row["num_parameters"] == psi
    assert row["comm_bus_bytes_per_step"] == row["comm_bus_theory_bytes_per_step"] == 4 * psi  # 2(N-1)/N x 4 Psi
