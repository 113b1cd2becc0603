"""Hugging Face decoders on every engine at 3 ranks against one process, in float64: a Mistral
(untied head) and a Qwen2 with tied embeddings, LoRA on and off, packed and padded rows, two micro
batches per rank (accumulation under `no_sync`), plain SGD (a gradient off by N shows in the
step). 3 ranks is where transformers' float32 norms once broke float64 parity: a rank's loss is
scaled by a factor that float32 does not round exactly ([Note: float32 islands in a float64 run]
in verify/float64.py). Both runs compute under `Float64Everywhere`, so what is compared is the
engines' arithmetic in float64; tests/test_verify_float64.py shows what the mode removes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import shardlab  # noqa: E402
from shardlab.models.hf import HFCausalLM  # noqa: E402
from shardlab.testing import run_workers  # noqa: E402
from shardlab.verify.float64 import Float64Everywhere  # noqa: E402
from tests.parity import F64_ATOL, F64_RTOL, assert_parity, micro_batch_sgd  # noqa: E402
from tests.test_chunked_loss import check_chunked_runs, chunked_runs  # noqa: E402
from tests.test_hf_models import sft_batch  # noqa: E402

VOCAB, T, WORLD, MICRO, STEPS = 53, 10, 3, 2, 3
GLOBAL = WORLD * MICRO * 2  # two micro batches per rank
ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": None}


def hf_config(arch: str):
    from transformers import MistralConfig, Qwen2Config

    kw = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)
    return MistralConfig(**kw, tie_word_embeddings=False) if arch == "mistral" else \
        Qwen2Config(**kw, tie_word_embeddings=True)


def build(arch: str, device: str, lora: bool) -> HFCausalLM:
    with torch.device(device):
        return HFCausalLM(hf_config(arch), seed=3, dtype=torch.float64, lora=LORA if lora else None)


def batch(step: int, packed: bool):
    """The global batch of a step (tests/test_hf_models.py's SFT rows: a masked prompt, packed rows
    of two examples with position ids restarting and no target across them)."""
    return sft_batch(step, packed, vocab=VOCAB, T=T, rows=GLOBAL, seed=200)


def reference(arch: str, packed: bool, lora: bool):
    """One process: the mean over every rank's micro batches of their mean losses."""
    with Float64Everywhere():
        return micro_batch_sgd(build(arch, "cpu", lora), lambda step: batch(step, packed), STEPS, MICRO, GLOBAL)


def _train(rank: int, world: int, arch: str, strategy: str, packed: bool, lora: bool):
    with Float64Everywhere():
        model = shardlab.parallelize(build(arch, "meta", lora), strategy, device="cpu")
        return micro_batch_sgd(model, lambda step: batch(step, packed), STEPS, MICRO, GLOBAL, rank, world)


def _all(rank: int, world: int, cases):
    return {**{case: _train(rank, world, *case) for case in cases}, "chunked": chunked_runs(rank, world)}


# each engine on both architectures; LoRA and packing alternate so every combination meets each arch
CASES = [(arch, strategy, (i + j) % 2 == 0, (i + j // 2) % 2 == 0)
         for j, strategy in enumerate(ENGINES) for i, arch in enumerate(("mistral", "qwen2-tied"))]


@pytest.fixture(scope="module")
def runs():
    return run_workers(WORLD, _all, CASES, timeout_s=420)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'packed' if c[2] else 'padded'}-"
                                                      f"{'lora' if c[3] else 'full'}")
def test_hf_decoder_engines_match_one_process_at_3_ranks(runs, case):
    arch, strategy, packed, lora = case
    assert_parity(reference(arch, packed, lora), runs[case], f"{arch}/{strategy}", rtol=F64_RTOL, atol=F64_ATOL)


@pytest.mark.slow
def test_the_chunked_loss_on_every_engine_at_3_ranks(runs):
    check_chunked_runs(runs["chunked"], WORLD)  # tests/test_chunked_loss.py


def test_the_cases_cover_every_combination():
    combos = {(arch, packed, lora) for arch, _, packed, lora in CASES}
    assert len(combos) == 8 and {s for _, s, _, _ in CASES} == set(ENGINES)
