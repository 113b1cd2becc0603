"""The token-weighted loss ([Note: token-weighted loss] in shardlab/loop/loss.py), through the real
`build_run`/`train_step`/`evaluate`:

- SFT rows with very different numbers of target tokens (2 to 29 per row), in float64: every
  engine at every (world size, micro batch) layout of the same global batch of 12 rows
  {(1, 12), (1, 2), (2, 1), (3, 2: accumulation 2)} gives the losses, validation loss and final
  parameters of one process with the whole batch, to 1e-10 (the harness's float64 tolerance,
  tests/parity.py). Before this, the same layouts differed by ~1e-2 (the mean of means).
- pretraining on fixed-length windows (every target counted) is unchanged: the step computes
  what the former `loss / accumulation` step computed, bit for bit, and the validation loss
  equals the former sample-weighted one to float rounding.

Tolerance: tests/parity.py's float64 one (|diff| <= 1e-10 + 1e-10 |ref|). Measured (2-core
AMD EPYC VM, torch 2.13 CPU, 2026-11-23, all 22 layouts below): max |diff| of final parameters
2.4e-14, of losses 2.6e-16 relative, i.e. 2.4e-4 of the tolerance. The former mean-of-means step
on the same rows, one process with micro batch 2 (or 1): losses 7.9e-3 (1.2e-2) relative apart,
parameters 4.2e-2, i.e. 4.1e8 x the tolerance.

[Note: why GPT-2 here]
Mistral's (and Llama's) RMSNorm computes in float32 even in a float64 model, which turns the
1e-16 differences of another summation order (ranks, micro batches) into up to 6.2e-10 relative
(measured with this test on mistral: ddp at N=3 failed the tolerance). GPT-2's blocks compute in
the model's dtype, so the comparison sees the float64 noise floor.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch

pytest.importorskip("transformers")

import shardlab  # noqa: E402
from shardlab.config import load_config  # noqa: E402
from shardlab.loop import train as T  # noqa: E402
from shardlab.loop.run import build_run  # noqa: E402
from shardlab.testing import run_workers  # noqa: E402
from tests.checkpoint_helpers import runtime  # noqa: E402
from tests.parity import F64_ATOL, F64_RTOL, assert_parity  # noqa: E402

ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
GLOBAL, STEPS = 12, 3
# (world size) -> [(strategy, micro batch)]: the layouts of one global batch of 12 rows
LAYOUTS = {
    1: [("single", 12), ("single", 2)] + [(e, mb) for e in ENGINES for mb in (12, 2)],
    2: [(e, 1) for e in ENGINES],
    3: [(e, 2) for e in ENGINES],  # 12 / (3 x 2): two micro batches per rank
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def write_sft_files(d) -> str:
    """A tiny GPT-2 config (see [Note: why GPT-2 here]) and 36 alpaca records whose responses are 1 to 60 words long (rows
    of 2 to 29 target tokens at seq_len 64, a third of them truncated), written here."""
    (d / "tiny.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 1000, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 96,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 2}))
    rnd = random.Random(3)
    lengths = [1, 60, 2, 3, 45, 1, 30, 8, 1, 50, 4, 12] * 3
    with open(d / "d.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"instruction": f"Say {i} words.", "output": " ".join(rnd.choices(WORDS, k=n))}) + "\n")
    (d / "cache").mkdir()
    return str(d)


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    return write_sft_files(tmp_path_factory.mktemp("token-loss"))


def _overrides(d: str, strategy: str, micro: int) -> list[str]:
    return [
        "model.name=hf", f"model.hf_config={d}/tiny.json", "model.hf_dtype=fp64",
        "data.source=sft", f"data.path={d}/d.jsonl", "data.seq_len=64", "data.val_fraction=0.2",
        f"train.steps={STEPS}", f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={micro}",
        "train.lr=0.01", "train.warmup_steps=0", "train.weight_decay=0.1", "train.grad_clip=1.0",
        "train.eval_batches=1", "train.memory_tracking=none", f"parallel.strategy={strategy}",
        "checkpoint.resume=none", "preemption.enabled=false", "output.tensorboard=false",
        "output.progress=false", f"output.dir={d}/runs", "output.run_name=layout", "parallel.timeout_s=120"]


def _run_layouts(rank: int, world: int, d: str) -> dict:
    """Every layout of LAYOUTS[world] through build_run/train_step/evaluate (one spawn)."""
    import os

    from shardlab.loop.evaluate import evaluate

    os.environ["SHARDLAB_CACHE"] = os.path.join(d, "cache")
    out = {}
    for strategy, micro in LAYOUTS[world]:
        cfg = load_config(None, _overrides(d, strategy, micro))
        run = build_run(cfg, runtime(rank, world, strategy))
        losses = []
        for _ in range(STEPS):
            losses.append(T.train_step(run).loss)
            run.opt.zero_grad(set_to_none=True)
            run.state.step += 1
        val = evaluate(run.model, run.data.val, cfg.train, run.rt)
        out[(strategy, world, micro)] = (losses + [val], shardlab.full_state_dict(run.model))
    if world == 2:
        out["pretraining"] = _pretraining_old_and_new(rank, world, ("ddp", "fsdp"))
    return out


@pytest.fixture(scope="module")
def layout_runs(sft_files, monkeypatch_module):
    monkeypatch_module.setenv("SHARDLAB_CACHE", f"{sft_files}/cache")
    from shardlab.data import sft

    sft.prepare(load_config(None, _overrides(sft_files, "single", GLOBAL)))  # once, before the workers
    return {world: run_workers(world, _run_layouts, sft_files, timeout_s=400)[0] for world in LAYOUTS}


@pytest.mark.slow
def test_every_layout_and_engine_equals_one_big_batch(layout_runs):
    ref = layout_runs[1][("single", 1, GLOBAL)]
    counts = {}
    for world, runs in layout_runs.items():
        for key, got in runs.items():
            if key == "pretraining":
                continue
            assert_parity(ref, got, f"{key[0]} world {key[1]} micro {key[2]}", rtol=F64_RTOL, atol=F64_ATOL)
            counts[world] = counts.get(world, 0) + 1
    assert counts == {w: len(v) for w, v in LAYOUTS.items()}
    assert len({round(x, 6) for x in ref[0]}) == STEPS + 1  # it trained: the losses move


def test_variable_rows_make_the_mean_of_means_differ(sft_files, monkeypatch):
    """The data above is a real test of the weighting: the former mean of micro-batch means
    differs from the token mean by far more than the tolerance (in one process, float64)."""
    monkeypatch.setenv("SHARDLAB_CACHE", f"{sft_files}/cache")
    from shardlab.data import build_datasets
    from shardlab.loop.loss import count_targets
    from shardlab.models import build_model

    cfg = load_config(None, _overrides(sft_files, "single", GLOBAL))
    data = build_datasets(cfg)
    model = build_model(cfg.model, seed=cfg.seed, vocab_size=data.vocab_size, device="cpu")
    x, y = shardlab.data.collate(data.train, torch.arange(GLOBAL))
    counts = [count_targets(row) for row in y]
    assert max(counts) >= 10 * min(counts)  # rows of 2 to 29 target tokens
    with torch.no_grad():
        token_mean = model(x, y).item()
        mean_of_means = sum(model(x[i:i + 2], y[i:i + 2]).item() for i in range(0, GLOBAL, 2)) / (GLOBAL // 2)
    assert abs(token_mean - mean_of_means) > 1e3 * F64_RTOL * abs(token_mean)


# -- pretraining windows: unchanged ----------------------------------------------------------------
def _old_train_step(run) -> float:
    """The step before the token weighting: each micro batch's mean / accumulation, a float32
    sum, averaged over ranks (what train_step computed until 2026-11-23)."""
    import torch.distributed as dist

    from shardlab.data import collate

    t, rt, model = run.cfg.train, run.rt, run.model
    idx = run.sampler.rank_indices(run.state.step, rt.rank, rt.world_size)
    local = torch.zeros(())
    for i in range(run.accumulation):
        x, y = collate(run.data.train, idx[i * t.micro_batch_size:(i + 1) * t.micro_batch_size])
        with contextlib.nullcontext() if i == run.accumulation - 1 else shardlab.no_sync(model):
            loss = model(x, y) / run.accumulation
            loss.backward()
        local += loss.detach().float()
    shardlab.clip_grad_norm_(model, t.grad_clip)
    run.opt.step()
    run.sched.step()
    if rt.world_size > 1:
        dist.all_reduce(local)
        local = local / rt.world_size
    return local.item()


def _old_evaluate(model, dataset, cfg, rt) -> float:
    """The former validation loss: micro-batch means weighted by rows, whole global batches."""
    import torch.distributed as dist

    from shardlab.data import GlobalBatchSampler, collate

    t = cfg.train
    per_rank = t.global_batch_size // rt.world_size
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, 0, shuffle=False)
    total = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for b in range(min(t.eval_batches, sampler.steps_per_epoch)):
            idx = sampler.rank_indices(b, rt.rank, rt.world_size)
            for i in range(0, per_rank, t.micro_batch_size):
                x, y = collate(dataset, idx[i:i + t.micro_batch_size])
                loss = model(x, y)
                total += torch.stack([loss.float() * len(x), torch.tensor(float(len(x)))])
    if rt.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def _pretraining_old_and_new(rank: int, world: int, strategies) -> dict:
    """gpt-nano on the embedded corpus, 3 steps of 4 micro batches, the new and the old step."""
    from shardlab.loop.evaluate import evaluate

    out = {}
    for strategy in strategies:
        cfg = load_config("configs/gpt-tiny.yaml", [
            "model.preset=gpt-nano", "data.seq_len=32", "train.global_batch_size=16",
            f"train.micro_batch_size={16 // (4 * world)}", "train.eval_batches=2", f"parallel.strategy={strategy}",
            "checkpoint.resume=none", "preemption.enabled=false", "train.memory_tracking=none",
            "output.run_name=unused"])
        result = {}
        for name, step in (("new", lambda run: T.train_step(run).loss), ("old", _old_train_step)):
            run = build_run(cfg, runtime(rank, world, strategy))
            losses = []
            for _ in range(3):
                losses.append(step(run))
                run.opt.zero_grad(set_to_none=True)
                run.state.step += 1
            val = evaluate(run.model, run.data.val, cfg.train, run.rt)
            old_val = _old_evaluate(run.model, run.data.val, cfg, run.rt)
            result[name] = (losses, val, old_val, shardlab.full_state_dict(run.model))
        out[strategy] = result
    return out


def _assert_pretraining_unchanged(result: dict) -> None:
    new, old = result["new"], result["old"]
    assert new[0] == old[0]  # losses, bit for bit
    for k, v in old[3].items():
        assert torch.equal(new[3][k], v), k
    # validation: the same rows; token-weighted (float64 sum) vs row-weighted (float32 sum)
    assert new[1] == pytest.approx(new[2], rel=1e-6)


def test_pretraining_unchanged_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    result = _pretraining_old_and_new(0, 1, ("single",))["single"]
    _assert_pretraining_unchanged(result)


@pytest.mark.slow
def test_pretraining_unchanged_two_ranks(layout_runs):
    for result in layout_runs[2]["pretraining"].values():
        _assert_pretraining_unchanged(result)


def test_validation_smaller_than_a_global_batch_is_evaluated(sft_files, monkeypatch):
    """7 validation rows, a global batch of 12: the validation loss is the token mean of all 7
    (before, it was silently None)."""
    monkeypatch.setenv("SHARDLAB_CACHE", f"{sft_files}/cache")
    from shardlab.data import build_datasets, collate
    from shardlab.loop.evaluate import evaluate
    from shardlab.loop.runtime import Runtime
    from shardlab.models import build_model

    cfg = load_config(None, _overrides(sft_files, "single", 2))
    data = build_datasets(cfg)
    assert 0 < len(data.val) < GLOBAL
    model = build_model(cfg.model, seed=cfg.seed, vocab_size=data.vocab_size, device="cpu")
    x, y = collate(data.val, torch.arange(len(data.val)))
    with torch.no_grad():
        want = model(x, y).item()  # the mean over every target token of the split
    got = evaluate(model, data.val, cfg.train, Runtime(0, 0, 1, torch.device("cpu"), None))
    assert got == pytest.approx(want, rel=1e-12)
