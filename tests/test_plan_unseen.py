"""`shardlab plan` on HF decoders the rest of the suite does not use (issue 25): Llama, Qwen2 and
Mistral configs written here (hidden 320, 7 layers, vocab 3001, seq 96, micro batch 3; random
init, nothing downloaded), at 2 and 3 ranks: every engine's predicted peak within 10 % of the
peak `shardlab train` measures (tests/plan_measure.py). The suite's budget (15 minutes on CI)
keeps the Llama at 2 ranks, the issue's case, in `make test`; SHARDLAB_PLAN_SWEEP=1 runs the
whole table, the three decoders at 2 and 3 ranks (all within 10 % when run, 2026-11-23:
docs/memory.md). One spawn per world size
trains every model and engine; plan's probes (fake tensors) run one child per model and world size."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from shardlab.config import load_config
from shardlab.plan import predict_all

TOLERANCE = 0.10  # the bar
ENGINES = ["ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp"]
SHAPE = {"vocab_size": 3001, "hidden_size": 320, "intermediate_size": 864, "num_hidden_layers": 7,
         "num_attention_heads": 5, "num_key_value_heads": 5, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
DECODERS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 1},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None,
                "num_key_value_heads": 1},
}


def _overrides(path: str) -> list[str]:
    return ["model.name=hf", f"model.hf_config={path}", "data.source=synthetic", "data.seq_len=96",
            "train.micro_batch_size=3", "train.global_batch_size=6", "train.steps=2"]


def _measure_all(rank: int, world: int, cases: list, out_dir: str) -> dict:
    from tests.plan_measure import _measure_worker

    return {name: _measure_worker(rank, world, None, overrides, ENGINES, f"{out_dir}/{name}")
            for name, overrides in cases}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_unseen_decoders_within_10_percent(tmp_path, world):
    pytest.importorskip("transformers")
    from shardlab.testing import run_workers

    sweep = os.environ.get("SHARDLAB_PLAN_SWEEP") == "1"
    if world == 3 and not sweep:
        pytest.skip("the suite's budget: the Llama at 2 ranks only; SHARDLAB_PLAN_SWEEP=1 runs the whole table")
    cases = []
    for name, arch in DECODERS.items():
        if name != "llama" and not sweep:
            continue
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**SHAPE, **arch}))
        overrides = _overrides(str(path))
        if world == 3:
            overrides[-2] = "train.global_batch_size=9"
        cases.append((name, overrides))
    with tempfile.TemporaryDirectory(prefix="shardlab-unseen-") as tmp:
        measured = run_workers(world, _measure_all, cases, tmp, timeout_s=600)[0]
    errors = {}
    for name, overrides in cases:
        predicted = predict_all(load_config(None, overrides), world, ENGINES)
        for e in ENGINES:
            m = measured[name][e]["peak_live_bytes"]
            errors[name, e] = round((predicted[e].peak_bytes - m) / m, 4)
    print(f"plan vs measured at N={world}:", errors)
    assert all(abs(err) <= TOLERANCE for err in errors.values()), errors
