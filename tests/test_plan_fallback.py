"""plan's fake-tensor probe meeting a kernel whose meta path refuses what its CPU kernel takes
(torch._grouped_mm's asks for bf16, as CUDA's does: transformers' default experts of an MoE model
in float32): `--probe auto` probes on real tensors and says so in one line; `--probe fake` stops in
one line naming `--probe real`. The probe child is replaced here (no process): what is checked is
the decision and its words, the real probe's figures are tests/test_plan_fake.py's."""

from __future__ import annotations

import importlib
import multiprocessing as mp

import pytest

from shardlab.config import ConfigError, load_config

predict = importlib.import_module("shardlab.plan.predict")  # (shardlab.plan.predict is also a function's name)

REFUSED = "Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32."
CFG = ["model.preset=gpt-nano", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4",
       "train.micro_batch_size=2"]


@pytest.fixture
def probe_calls(monkeypatch):
    calls = []

    def child(fn, to_build, plans, *args, **kwargs):
        calls.append({e: p["fake"] for e, p in plans.items()})
        if any(calls[-1].values()):
            raise RuntimeError(REFUSED + "\nmore of the child's text")
        raise mp.TimeoutError  # the real probe's figures are not this test's: plan's own no-probe path

    monkeypatch.setattr(predict, "in_child", child)
    return calls


def test_auto_probes_on_real_tensors_and_says_so_once(probe_calls, capsys):
    out = predict.predict_all(load_config(None, CFG), 2, ["fsdp"], probe="auto")
    assert probe_calls == [{"fsdp": True}, {"fsdp": False}]
    err = capsys.readouterr().err
    assert err == f"plan: the probe on fake tensors failed ({REFUSED}); probing on real tensors\n"
    assert out["fsdp"].probe == "none" and not out["fsdp"].probed  # the replaced child gave no probe


def test_fake_stops_in_one_line_naming_the_real_probe(probe_calls):
    with pytest.raises(ConfigError) as e:
        predict.predict_all(load_config(None, CFG), 2, ["fsdp"], probe="fake")
    assert str(e.value) == f"the probe on fake tensors failed ({REFUSED}); --probe real (or auto) probes on real ones"
    assert probe_calls == [{"fsdp": True}]
