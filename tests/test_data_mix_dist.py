"""Training on a mixture of prepared corpora (data.mix) across processes, in float64: exact resume
at 2 ranks; a 2-rank checkpoint resumed at 3 ranks trains each step on the same global samples
(source, index), bit for bit, as the uninterrupted 2-rank run, and its losses agree to the float64
parity tolerance; the summary's per-corpus counts equal a count of the samples the sampler hands
out; the validation loss per corpus, in metrics.json and TensorBoard. One spawn per world size."""

from __future__ import annotations

import os

import pytest
import torch

from shardlab.checkpoint import read_tensors
from shardlab.data import build_datasets, make_sampler
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
from tests.test_data_mix import corpora  # noqa: F401 (a fixture)
from tests.test_prepare_dist import step_path

pytestmark = pytest.mark.slow

COMMON = ("model.dropout=0.0", "train.micro_batch_size=1", "data.source=tokens")


def _cfg(out: str, name: str, a: str, b: str, *extra: str):
    return make_cfg("fsdp", out, name, *COMMON, f"data.mix={{{a}: 0.7, {b}: 0.3}}", *extra)


def _two(rank: int, world: int, out: str, a: str, b: str) -> dict:
    rt, samples = runtime(rank, world, "fsdp"), SampleLog()
    in_float64()
    straight = T.train(_cfg(out, "straight", a, b, "output.tensorboard=true"), rt)
    straight_ids = samples.take()
    train_until_crash(_cfg(out, "resumed", a, b), rt)
    resumed = T.train(_cfg(out, "resumed", a, b), rt)
    return {"straight": straight, "resumed": resumed, "straight_ids": straight_ids, "resumed_ids": samples.take()}


def _three(rank: int, world: int, out: str, a: str, b: str, source: str) -> dict:
    rt, samples = runtime(rank, world, "fsdp"), SampleLog()
    in_float64()
    return {"from_two": T.train(_cfg(out, "from-two", a, b, f"checkpoint.resume={source}"), rt),
            "ids": samples.take()}


def _tensorboard(run: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run, "tensorboard")).Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"] if tag.startswith("val/")}


def test_mixture_resumes_exactly_and_at_another_world_size(corpora, tmp_path):  # noqa: F811
    a, b = corpora
    out = str(tmp_path)
    two = run_workers(2, _two, out, a, b, timeout_s=600)   # the spawns' timeouts: hang guards only
    straight, resumed = two[0]["straight"], two[0]["resumed"]
    assert resumed["losses"] == straight["losses"]  # bitwise: step s reads the same windows after a resume
    assert_same_tensors(step_path(out, "straight", TOTAL), step_path(out, "resumed", TOTAL))
    ids = global_ids([r["straight_ids"] for r in two], range(TOTAL))
    assert global_ids([r["resumed_ids"] for r in two], range(TOTAL)) == ids
    assert all(len(v) == 12 and {s for s, _ in v} == {0, 1} for v in ids.values())  # both corpora, every step

    # the summary's per-corpus counts are those of the samples the sampler hands out, resumed or not
    data = build_datasets(_cfg(out, "count", a, b))
    sampler, counted = make_sampler(data, 12, 0, True), [0, 0]
    for step in range(TOTAL):
        for i in sampler.global_indices(step).tolist():
            counted[data.train.source_of(i)] += 1
    assert [s["samples"] for s in straight["data_sources"]] == counted == [s["samples"] for s in resumed["data_sources"]]
    assert [s["samples"] for s in straight["data_sources"]] == [sum(s == j for s, _ in sum(ids.values(), []))
                                                                 for j in (0, 1)]  # what the loader fetched
    assert [s["tokens"] for s in straight["data_sources"]] == [c * 16 for c in counted]
    assert [s["samples_this_run"] for s in resumed["data_sources"]] == [
        c - k for c, k in zip(counted, sampler.samples_before(K))]

    three = run_workers(3, _three, out, a, b, step_path(out, "resumed", K), timeout_s=600)
    from_two = three[0]["from_two"]
    # bitwise: steps K.. of the 3-rank resume train on the 2-rank run's global samples
    assert global_ids([r["ids"] for r in three], range(K, TOTAL)) == {s: ids[s] for s in range(K, TOTAL)}
    assert from_two["losses"][:K] == straight["losses"][:K]  # restored from the 2-rank checkpoint
    # the same 12 samples per step summed in another grouping: float64 rounding only
    # (consecutive steps' losses differ by > 0.1, so another batch would show)
    got, ref = torch.tensor(from_two["losses"], dtype=torch.float64), torch.tensor(straight["losses"],
                                                                                   dtype=torch.float64)
    print(f"largest relative loss difference, 2->3 resume vs uninterrupted 2 ranks (float64): "
          f"{float(((got - ref).abs() / ref).max()):.1e}")
    torch.testing.assert_close(got, ref, rtol=F64_RTOL, atol=0.0)
    mine, theirs = (read_tensors(step_path(out, n, TOTAL), "model/") for n in ("from-two", "straight"))
    assert all(t.dtype == torch.float64 for t in theirs.values())  # in_float64 took effect
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=F64_RTOL, atol=F64_ATOL)

    # validation loss per corpus: metrics.json and TensorBoard, beside the overall one, the same
    # at 3 ranks (float64 rounding); the overall one lies between them (token-weighted)
    names = [s["name"] for s in straight["data_sources"]]
    per = [straight[f"val_loss/{n}"] for n in names]
    assert min(per) < straight["val_loss"] < max(per)
    torch.testing.assert_close(torch.tensor([from_two[f"val_loss/{n}"] for n in names], dtype=torch.float64),
                               torch.tensor(per, dtype=torch.float64), rtol=F64_RTOL, atol=0.0)
    board = _tensorboard(os.path.join(out, "straight"))
    assert board["val/loss"][-1] == pytest.approx(straight["val_loss"], rel=1e-6)  # TensorBoard keeps float32
    assert [board[f"val/loss/{n}"][-1] for n in names] == pytest.approx(per, rel=1e-6)
