"""Exits that never crash: after a finished run nothing that holds the process group is left for
interpreter finalization (see [Note: tearing down the process group] in shardlab/loop/runtime.py).

The crash this guards against ("terminate called without an active exception", SIGABRT after
metrics.json was written) struck about one run in seven and only at process exit, so repeating
CLI runs would be a slow and weak test. This one checks its cause directly, once per engine,
inside one spawn: after `worker_main` returns, no module, engine or optimizer of the run is
alive and the group is destroyed, so finalization has nothing of torch.distributed to tear down.
"""

import gc

import torch
import torch.distributed as dist
from torch import nn

from shardlab.testing import run_workers

STRATEGIES = ["torch-ddp", "torch-fsdp", "ddp", "zero3", "fsdp"]


def _run_each_engine(rank, world, out_dir):
    from shardlab.config import load_config
    from shardlab.engines.api import Engine
    from shardlab.loop.train import worker_main

    report = {}
    for strategy in STRATEGIES:
        if not dist.is_initialized():  # worker_main destroyed the group of the previous engine
            dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store-{strategy}", world),
                                    rank=rank, world_size=world)
        cfg = load_config("configs/gpt-tiny.yaml", [
            f"parallel.strategy={strategy}", "model.preset=gpt-nano", "data.source=synthetic",
            "data.seq_len=16", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.eval_batches=1", f"output.dir={out_dir}", f"output.run_name={strategy}",
            "output.progress=false", "output.tensorboard=false",
            # each process is a one-worker run (no RANK/WORLD_SIZE in its environment) over this test's
            # two-rank group, both in one directory: a final checkpoint would be two runs writing one
            # step_* at once. Checkpoints' teardown is tested where runs are real (test_checkpoint*).
            "checkpoint.final=false"])
        code = worker_main(cfg)
        alive = [type(o).__name__ for o in gc.get_objects()
                 if isinstance(o, (nn.Module, Engine, torch.optim.Optimizer))]
        report[strategy] = (code, dist.is_initialized(), alive)
    # the harness destroys its group on return: give it one, and meet in it once before returning.
    # Without a collective, a rank that finished connecting could return and close its sockets while
    # the other was still in gloo's connectFullMesh: "Connection closed by peer" (seen once, 2026-11-23).
    dist.init_process_group("gloo", store=dist.FileStore(f"{out_dir}/store-end", world), rank=rank,
                            world_size=world)
    dist.barrier()
    return report


def test_finished_runs_leave_nothing_for_finalization(tmp_path):
    for rank_report in run_workers(2, _run_each_engine, str(tmp_path), timeout_s=300):
        for strategy, (code, initialized, alive) in rank_report.items():
            assert code == 0, strategy
            assert not initialized, f"{strategy}: the process group outlived worker_main"
            assert alive == [], f"{strategy}: still alive after shutdown: {sorted(set(alive))}"
