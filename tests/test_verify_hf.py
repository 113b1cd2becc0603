"""`shardlab verify` on Hugging Face decoders at 3 ranks, where transformers' float32 norms once made
it cry wolf (verify/float64.py, [Note: float32 islands in a float64 run]).

One spawn of 3 workers runs every case, one step each (forward, backward, clip and step): the
shipped tiny Mistral (untied) on rows of the false alarm (fsdp with LoRA, with and without
accumulation; ddp full fine-tuning, packed), and a Qwen2 with tied embeddings, LoRA, packing and a
chat template of its own on every engine; all with accumulation unless said. (docs/verify.md has
every row of the false alarm measured through the command; tests/test_hf_families.py runs verify
at 3 ranks on every decoder family.) Each must be EQUAL with its largest error at most
100x its noise floor. Then a model with a float32 island the mode cannot remove: EQUAL at float32's
tolerance, the module named, averaging never blamed."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from shardlab.testing import run_workers
from tests.test_hf_roundtrip import TEMPLATES, _conversations, user_tokenizer

pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
QWEN2_TIED = {"model_type": "qwen2", "vocab_size": 400, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": True}


def _sft(model: dict, strategy: str, *, lora: int = 4, packing: bool = False, global_batch: int = 12) -> dict:
    return {"model": {"name": "hf", **model, "lora": {"rank": lora}},
            "data": {"source": "sft", "seq_len": 48, "packing": packing, "val_fraction": 0.0},
            # plain SGD: an N x gradient error shows in the step, and no AdamW division by sqrt(v) + eps
            # amplifies the rounding of gradients that are zero in exact arithmetic (verify/tolerance.py)
            "train": {"global_batch_size": global_batch, "micro_batch_size": 2, "warmup_steps": 1,
                      "optimizer": "sgd", "momentum": 0.9, "lr": 0.1},
            "parallel": {"strategy": strategy}}


def _cases(paths: dict[str, str]) -> dict[str, tuple[dict, str | None]]:
    mistral = {"hf_config": os.path.join(ROOT, "configs/hf/mistral-tiny.json")}
    qwen2 = {"hf_config": paths["qwen2"]}
    cases: dict[str, tuple[dict, str | None]] = {
        "mistral-fsdp-lora": (_sft(mistral, "fsdp"), None),
        "mistral-ddp-full-packed": (_sft(mistral, "ddp", lora=0, packing=True), None),
        "mistral-fsdp-lora-no-accumulation": (_sft(mistral, "fsdp", global_batch=6), None),
    }
    for strategy in ENGINES:
        cases[f"qwen2-tied-chat-{strategy}"] = (_sft(qwen2, strategy, packing=True), None)
    cases["float32-island-ddp"] = ({"model": {"name": "mlp", "mlp_sizes": [8, 16, 4]},
                                    "data": {"source": "synthetic", "synthetic_samples": 64},
                                    "train": {"global_batch_size": 12, "micro_batch_size": 2, "optimizer": "sgd",
                                              "lr": 0.1},
                                    "parallel": {"strategy": "ddp"}}, "float32-island")
    for name, (raw, _) in cases.items():
        if raw["data"]["source"] == "sft":
            raw["data"]["path"] = paths["data"]
            if name.startswith("qwen2"):
                raw["data"]["tokenizer_path"] = paths["tokenizer"]
    return cases


def _run(rank: int, world: int, root: str, cases: dict) -> dict:
    from shardlab.config import config_from_dict
    from shardlab.loop.runtime import Runtime
    from shardlab.verify.command import make_plan
    from shardlab.verify.compare import compare
    from shardlab.verify.runs import verify_worker
    from tests import verify_faults

    rt = Runtime(rank, rank, world, torch.device("cpu"), "gloo")
    out = {}
    for name, (raw, model) in cases.items():
        verify_faults.use(None, model)
        args = argparse.Namespace(nproc=world, steps=1, against="single", dtype="float64", layers=None,
                                  keep_dropout=False)
        workdir = os.path.join(root, name)
        os.makedirs(workdir, exist_ok=True)
        out[name] = verify_worker(rt, make_plan(config_from_dict(raw), args, workdir), compare)
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("verify-hf")
    monkeypatch_module.setenv("SHARDLAB_CACHE", str(root / "cache"))
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(96)))
    (root / "qwen2.json").write_text(json.dumps(QWEN2_TIED))
    tokenizer = user_tokenizer(root / "tok", TEMPLATES["no-bos"])
    cases = _cases({"qwen2": str(root / "qwen2.json"), "data": str(data), "tokenizer": tokenizer})
    return run_workers(3, _run, str(root), cases, timeout_s=600)[0]


HF_CASES = [n for n in _cases({"qwen2": "", "data": "", "tokenizer": ""}) if not n.startswith("float32")]


@pytest.mark.slow
@pytest.mark.parametrize("name", HF_CASES)
def test_hf_decoders_at_3_ranks_are_equal(reports, name):
    r = reports[name]
    assert r.equal, f"{name}: first difference {r.first}, {r.where}, {r.cause}"
    assert r.tolerance.dtype_name == "float64"
    assert max(row.worst.error for row in r.rows) <= 100 * r.noise_floor, [row.worst for row in r.rows]
    assert any("float32 casts kept in float64" in n and "RMSNorm" in n for n in r.notes), r.notes


@pytest.mark.slow
def test_a_float32_island_is_named_and_never_blamed_on_averaging(reports):
    r = reports["float32-island-ddp"]
    assert r.equal, f"first difference {r.first}, {r.cause}"
    assert r.tolerance.dtype_name == "float32"
    assert any("computing in float32 inside a float64 run" in n and "Float32IslandMLP: copy_" in n
               for n in r.notes), r.notes
    # the rounding it leaves is float32's, far above float64's: the tolerance, not luck, makes it equal
    assert max(row.worst.error for row in r.rows) > 1e-12
