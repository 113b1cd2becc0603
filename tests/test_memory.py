"""The live-memory tracker (shardlab.memory): exact on a case computed by hand, consistent with
the engines' own model-state accounting at N=2, wired into `shardlab train` (metrics.json), and
`train.profile=true` writes a loadable Chrome trace.

One spawn for the engines at N=2 (all cases inside), one CLI run at N=2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardlab.config import ConfigError, load_config
from shardlab.memory import PARTS, LiveMemoryTracker, module_parameters
from shardlab.testing import run_workers


def _step(tracker: LiveMemoryTracker, index: int, model, x, opt, loss_fn) -> None:
    with tracker.step(index):
        with tracker.phase("forward"):
            loss = loss_fn(model, x)
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            opt.step()
    opt.zero_grad(set_to_none=True)


def test_linear_stack_peak_is_computed_by_hand():
    """L bias-free Linear(d, d) layers, then a Linear(d, 1) head, loss = sum of the outputs,
    AdamW (foreach=False), the input made outside the tracker. Byte sizes: a = B*d*4 (one
    activation), w = d*d*4 (one weight), h = d*4 (the head), P = L*w + h (parameters),
    S = 2P + 4(L+1) (Adam's two moments and a 4-byte step counter per parameter).

    Forward peak: the L layer outputs, the head's output (4B) and the loss (4), on top of P + S.
    Backward peak, second step, at layer L's backward: the saved inputs of layers 1..L-1
    ((L-1)a), the gradient arriving from the head (a), the input gradient and weight gradient it
    computes (a + w), the head's weight gradient (h), the loss and backward's seed (8).

    Tolerance: none. Every tensor here is at least 256 bytes and the figure is exact; a
    difference would mean a tensor missed or counted twice."""
    torch.manual_seed(0)
    B, d, L = 2048, 64, 4
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(L)], nn.Linear(d, 1, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(B, d)
    tracker = LiveMemoryTracker("cpu", optimizer=opt, params=module_parameters(model))
    for i in range(2):
        _step(tracker, i, model, x, opt, lambda m, x: m(x).sum())
    a, w, h = B * d * 4, d * d * 4, d * 4
    P = L * w + h
    S = 2 * P + 4 * (L + 1)
    s = tracker.summary()
    assert s["peak_live_bytes"] == P + S + (L + 1) * a + w + h + 8
    assert s["phase"] == "backward" and s["step"] == 1
    assert s["phase_peaks"]["forward"] == P + S + L * a + 4 * B + 4
    parts = s["parts"]
    assert sum(parts.values()) == s["peak_live_bytes"] and set(parts) == set(PARTS)
    assert parts["params"] == P and parts["optimizer"] == S
    # the weight gradient computed at the peak is a gradient, though autograd had not stored it yet
    assert parts["grads"] == w + h
    assert parts["activations"] == (L + 1) * a + 8
    # at the step's end: parameters, gradients, optimizer state and the loss (4 bytes, still referenced)
    assert s["step_end"]["parts"]["grads"] == P and s["step_end"]["live_bytes"] == P + P + S + 4
    # after zero_grad only the parameters and the optimizer state are alive: everything else was seen to die
    assert tracker.live == P + S and "inconsistencies" not in s
    tracker.close()


def test_inactive_steps_are_not_measured():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = LiveMemoryTracker("cpu", optimizer=opt, params=module_parameters(model))
    x = torch.randn(512, 32)
    with tracker.step(0, active=False):
        model(x).sum().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    assert tracker.summary()["steps_tracked"] == 0 and tracker.peak == 0
    assert tracker.live == sum(p.numel() * 4 for p in model.parameters())
    tracker.close()


def test_memory_tracking_values_are_checked():
    with pytest.raises(ConfigError, match="train.memory_tracking.*last, all, none"):
        load_config(None, ["train.memory_tracking=some"])
    with pytest.raises(ConfigError, match="train.profile_steps"):
        load_config(None, ["train.profile_steps=0"])


# -- the engines at N=2 ---------------------------------------------------------------------------
ENGINES = ("ddp", "fsdp", "zero3", "torch-fsdp")


def _engines_worker(rank: int, world: int) -> dict:
    """gpt-tiny, micro batch 1 x 16 tokens (activations small beside 0.84M parameters), AdamW,
    three tracked steps per engine."""
    import shardlab
    from shardlab.engines import engine_of, optimizer_state_bytes
    from shardlab.models import GPT, GPT_PRESETS

    torch.manual_seed(rank)
    x = torch.randint(0, 256, (1, 16))
    out = {}
    for strategy in ENGINES:
        with torch.device("meta"):
            model = GPT(GPT_PRESETS["gpt-tiny"])
        model = shardlab.parallelize(model, strategy, device="cpu")
        engine = engine_of(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        tracker = LiveMemoryTracker("cpu", engine=engine, optimizer=opt)
        for i in range(3):
            with tracker.step(i):
                with tracker.phase("forward"):
                    loss = model(x, x)
                with tracker.phase("backward"):
                    loss.backward()
                with tracker.phase("optimizer"):
                    shardlab.clip_grad_norm_(model, 1.0)
                    opt.step()
            state = {**engine.model_state_bytes(), "optimizer": optimizer_state_bytes(opt),
                     # optimizer_state_bytes leaves out AdamW's 0-d step counters (4 bytes each)
                     "step_counters": 4 * len(opt.state)}
            opt.zero_grad(set_to_none=True)
        out[strategy] = {"summary": tracker.summary(), "state": state}
        tracker.close()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(2, _engines_worker, timeout_s=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ENGINES)
def test_breakdown_agrees_with_the_engines_model_state(two_ranks, strategy):
    for rank in range(2):
        s, state = two_ranks[rank][strategy]["summary"], two_ranks[rank][strategy]["state"]
        parts = s["parts"]
        assert sum(parts.values()) == s["peak_live_bytes"] and "inconsistencies" not in s
        assert s["phase"] == "backward" and s["steps_tracked"] == 3
        # between steps the tracker's parameters + gradients + optimizer state are the engine's own figures
        end = s["step_end"]["parts"]
        assert end["params"] == state["params"]
        assert end["grads"] == state["grads"]
        assert end["optimizer"] == state["optimizer"] + state["step_counters"]
        # at the peak, parameters and optimizer state are all there; gradients are on their way
        assert parts["params"] == state["params"]
        assert parts["optimizer"] == state["optimizer"] + state["step_counters"]
        if strategy == "ddp":
            # the peak is the end of backward: every gradient, plus the bucket buffer being all-reduced
            assert parts["grads"] == state["grads"] and parts["comm"] == state["grads"]
        else:
            # sharded: the gathered parameters and the unreduced (full) gradients are named,
            # and the gradient shards present are at most the final ones
            assert parts["gathered_params"] > 0 and parts["unsharded_grads"] > 0
            assert parts["grads"] <= state["grads"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_peak_below_ddp_at_two_ranks(two_ranks):
    for rank in range(2):
        ddp = two_ranks[rank]["ddp"]["summary"]["peak_live_bytes"]
        for strategy in ("fsdp", "zero3", "torch-fsdp"):
            assert two_ranks[rank][strategy]["summary"]["peak_live_bytes"] < ddp, strategy


# -- the CLI ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_reports_peak_live_bytes_and_writes_a_trace(tmp_path):
    cmd = [sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", "parallel.strategy=fsdp",
           "model.preset=gpt-nano", "data.seq_len=32", "train.steps=3", "train.global_batch_size=8",
           "train.profile=true", "train.profile_steps=1", "checkpoint.resume=none",
           f"output.dir={tmp_path}", "output.run_name=run", "output.progress=false", "output.tensorboard=false",
           "--nproc", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "run"
    m = json.loads((run / "metrics.json").read_text())
    assert len(m["peak_live_bytes"]) == 2 and len(m["peak_breakdown"]) == 2
    for live, rss, b in zip(m["peak_live_bytes"], m["peak_memory_bytes"], m["peak_breakdown"]):
        assert 0 < live < rss  # live tensors are a part of the process's resident memory
        assert sum(b["parts"].values()) == live and b["phase"] in ("forward", "backward", "optimizer")
        assert b["steps_tracked"] == 1 and b["step"] == 2  # the default: the last step only
        assert b["parts"]["params"] > 0 and b["parts"]["optimizer"] > 0
    assert "peak live tensors" in out.stdout
    for rank in range(2):
        trace = json.loads((run / "profile" / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"shardlab.forward", "shardlab.backward", "shardlab.optimizer"} <= names
        assert any(n.startswith("c10d::") or "gloo" in n for n in names)   # collectives are visible
        assert "[memory]" in names                                         # allocations and frees
