"""Training on prepared shards across processes, in float64: exact resume; resume at another
world size (2 -> 3) trains each step on the same global samples, bit for bit, as the
uninterrupted 2-rank run, its losses equal to the float64 parity tolerance; DataLoader worker
processes read the same batches; a resume on another corpus is refused. One spawn per world
size; each runs all of its cases."""

from __future__ import annotations

import os

import pytest
import torch

from shardlab.checkpoint import CheckpointError, read_tensors
from shardlab.data.prepare import prepare
from shardlab.loop import train as T
from shardlab.testing import run_workers
from tests.checkpoint_helpers import (
    TOTAL,
    K,
    SampleLog,
    assert_same_tensors,
    global_ids,
    in_float64,
    make_cfg,
    runtime,
    train_until_crash,
)
from tests.parity import F64_ATOL, F64_RTOL
from tests.test_prepare import DOCS, as_text_files

pytestmark = pytest.mark.slow

# global batch 12, micro batch 1: divides over 2 and 3 ranks; no dropout: the world sizes compare
COMMON = ("model.dropout=0.0", "train.micro_batch_size=1", "data.source=tokens", "data.val_fraction=0.0")


def step_path(out: str, name: str, step: int) -> str:
    return os.path.join(out, name, "checkpoints", f"step_{step:08d}")


def _cfg(out: str, name: str, data: str, *extra: str):
    return make_cfg("fsdp", out, name, *COMMON, f"data.path={data}", *extra)


def _two(rank: int, world: int, out: str, data: str, other: str) -> dict:
    rt, samples = runtime(rank, world, "fsdp"), SampleLog()
    in_float64()
    res = {"straight": T.train(_cfg(out, "straight", data), rt)["losses"], "straight_ids": samples.take()}
    res["loader_workers"] = T.train(_cfg(out, "workers", data, "data.num_workers=1"), rt)["losses"]
    res["workers_ids"] = samples.take()
    train_until_crash(_cfg(out, "resumed", data), rt)
    res["resumed"] = T.train(_cfg(out, "resumed", data), rt)["losses"]
    res["resumed_ids"] = samples.take()
    train_until_crash(_cfg(out, "other", data), rt)
    try:  # the same run directory, another corpus: the checkpoint's steps index other data
        T.train(_cfg(out, "other", other), rt)
        res["refused"] = None
    except CheckpointError as e:
        res["refused"] = str(e)
    return res


def _three(rank: int, world: int, out: str, data: str, source: str) -> dict:
    samples = SampleLog()
    in_float64()
    losses = T.train(_cfg(out, "three", data, f"checkpoint.resume={source}"), runtime(rank, world, "fsdp"))["losses"]
    return {"losses": losses, "ids": samples.take()}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("corpora")
    a = prepare([as_text_files(tmp, DOCS)], str(tmp / "a"), shard_mb=0.002)  # several shards
    (tmp / "b").mkdir()
    (tmp / "b" / "one.txt").write_text("".join(reversed(DOCS)))
    return a, prepare([str(tmp / "b")], str(tmp / "b-data"))


def test_resume_exact_and_at_another_world_size_on_prepared_data(corpora, tmp_path):
    data, other = corpora
    out = str(tmp_path)
    ranks = run_workers(2, _two, out, data, other, timeout_s=180)
    two = ranks[0]
    assert two["resumed"] == two["straight"]  # bitwise: the step indexes the same windows
    assert_same_tensors(step_path(out, "straight", TOTAL), step_path(out, "resumed", TOTAL))
    assert two["loader_workers"] == two["straight"]  # a DataLoader worker process reads the same batches
    assert two["refused"] and "manifest SHA-256" in two["refused"] and "data.path" in two["refused"]
    ids = global_ids([r["straight_ids"] for r in ranks], range(TOTAL))
    assert all(len(set(v)) == 12 for v in ids.values())
    for run in ("workers_ids", "resumed_ids"):
        assert global_ids([r[run] for r in ranks], range(TOTAL)) == ids, run

    three = run_workers(3, _three, out, data, step_path(out, "resumed", K), timeout_s=120)
    # bitwise: steps K.. at 3 ranks train on the global samples of the uninterrupted 2-rank run
    assert global_ids([r["ids"] for r in three], range(K, TOTAL)) == {s: ids[s] for s in range(K, TOTAL)}
    losses = three[0]["losses"]
    assert losses[:K] == two["straight"][:K]  # restored from the checkpoint
    # 3 ranks sum the same 12 samples in another grouping: float64 rounding only; the losses of
    # other batches (consecutive steps) differ by > 0.1
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(two["straight"], dtype=torch.float64), rtol=F64_RTOL, atol=0.0)
    mine = read_tensors(step_path(out, "three", TOTAL), "model/")
    ref = read_tensors(step_path(out, "straight", TOTAL), "model/")
    assert all(t.dtype == torch.float64 for t in ref.values())  # in_float64 took effect
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=F64_RTOL, atol=F64_ATOL)
