"""Training on a mixture of prepared corpora (data.mix) across processes: exact resume at 2 ranks,
resume of a 2-rank checkpoint at 3 ranks against an uninterrupted 3-rank run, and the summary's
per-corpus counts equal to a count of the samples the sampler hands out. One spawn per world size."""

from __future__ import annotations

import pytest
import torch

from shardlab.checkpoint import read_tensors
from shardlab.data import build_datasets, make_sampler
from shardlab.loop import train as T
from shardlab.testing import run_workers
from tests.checkpoint_helpers import TOTAL, K, assert_same_tensors, make_cfg, runtime, train_until_crash
from tests.test_data_mix import corpora  # noqa: F401 (a fixture)
from tests.test_prepare_dist import step_path

pytestmark = pytest.mark.slow

COMMON = ("model.dropout=0.0", "train.micro_batch_size=1", "data.source=tokens")


def _cfg(out: str, name: str, a: str, b: str, *extra: str):
    return make_cfg("fsdp", out, name, *COMMON, f"data.mix={{{a}: 0.7, {b}: 0.3}}", *extra)


def _two(rank: int, world: int, out: str, a: str, b: str) -> dict:
    rt = runtime(rank, world, "fsdp")
    straight = T.train(_cfg(out, "straight", a, b), rt)
    train_until_crash(_cfg(out, "resumed", a, b), rt)
    resumed = T.train(_cfg(out, "resumed", a, b), rt)
    return {"straight": straight["losses"], "resumed": resumed["losses"], "sources": straight["data_sources"],
            "resumed_sources": resumed["data_sources"], "val_loss": straight["val_loss"]}


def _three(rank: int, world: int, out: str, a: str, b: str, source: str) -> dict:
    rt = runtime(rank, world, "fsdp")
    return {"uninterrupted": T.train(_cfg(out, "three", a, b), rt)["losses"],
            "from_two": T.train(_cfg(out, "from-two", a, b, f"checkpoint.resume={source}"), rt)["losses"]}


def test_mixture_resumes_exactly_and_at_another_world_size(corpora, tmp_path):  # noqa: F811
    a, b = corpora
    out = str(tmp_path)
    two = run_workers(2, _two, out, a, b, timeout_s=180)[0]
    assert two["resumed"] == two["straight"]  # bitwise: step s reads the same windows after a resume
    assert_same_tensors(step_path(out, "straight", TOTAL), step_path(out, "resumed", TOTAL))
    assert two["val_loss"] is not None  # both corpora's val splits

    # the summary's per-corpus counts are those of the samples the sampler hands out, resumed or not
    data = build_datasets(_cfg(out, "count", a, b))
    sampler, counted = make_sampler(data, 12, 0, True), [0, 0]
    for step in range(TOTAL):
        for i in sampler.global_indices(step).tolist():
            counted[data.train.source_of(i)] += 1
    assert [s["samples"] for s in two["sources"]] == counted == [s["samples"] for s in two["resumed_sources"]]
    assert [s["tokens"] for s in two["sources"]] == [c * 16 for c in counted]
    assert [s["samples_this_run"] for s in two["resumed_sources"]] == [
        c - k for c, k in zip(counted, sampler.samples_before(K))]

    three = run_workers(3, _three, out, a, b, step_path(out, "resumed", K), timeout_s=120)[0]
    assert three["from_two"][:K] == two["straight"][:K]  # restored from the 2-rank checkpoint
    # the same 12 samples per step at 3 ranks, summed in another grouping: float32 reordering only
    # (consecutive steps' losses differ by > 0.1, so another batch would show)
    print("largest relative loss difference, 2->3 resume vs uninterrupted 3 ranks / 2 ranks:",
          [float(((torch.tensor(three["from_two"]) - torch.tensor(o)).abs() / torch.tensor(o)).max())
           for o in (three["uninterrupted"], two["straight"])])
    for other in (three["uninterrupted"], two["straight"]):
        assert torch.allclose(torch.tensor(three["from_two"]), torch.tensor(other), rtol=1e-5, atol=1e-6)
    mine, ref = read_tensors(step_path(out, "from-two", TOTAL), "model/"), read_tensors(step_path(out, "three", TOTAL),
                                                                                       "model/")
    assert all(torch.allclose(mine[k], ref[k], atol=2e-5) for k in ref)
