"""plan's fake-tensor probes (plan/probe.py, [Note: fake-tensor probes]): the engine's real step
under FakeTensorMode allocates what the same step allocates on real tensors. One spawned child
runs every case both ways at the same shape (depth, micro batch, sequence), and the live-memory
tracker's peaks, forward peaks and breakdowns are compared to the byte. torch-ddp's real probe runs
on a real one-rank gloo group (its hook's future needs one), its fake probe on the fake group with
PyTorch's reducer answered by plan/fake_ddp.py: equal to the byte as well, buckets (rebuilt in the
tracked step's first forward), no_sync gradients beside them and all."""

from __future__ import annotations

import pytest

from shardlab.config import load_config

GPT = ("configs/gpt-tiny.yaml", ["data.source=synthetic", "train.micro_batch_size=2", "train.global_batch_size=8",
                                 "data.seq_len=64"])
MISTRAL = ("configs/sft-mistral-tiny.yaml", ["data.source=synthetic", "data.packing=false", "train.micro_batch_size=2",
                                             "train.global_batch_size=4", "data.seq_len=32"])
#: (name, (config, overrides), world, engines, more overrides): plain fp32; bf16 mixed precision
#: with activation checkpointing; hybrid sharding (2 replicas of 2) at 4 ranks; CPU offload;
#: an HF decoder with LoRA adapters (transformers' own mask path: `_transformers_not_tracing`).
#: torch-ddp takes no mixed_precision or sharding options: it runs the first two and LoRA. One rank with
#: selective checkpointing (every other matmul kept): FSDP2's mesh coordinate is a real value there.
CASES = [
    ("fp32", GPT, 2, ["ddp", "zero3", "fsdp", "torch-fsdp", "torch-ddp"], []),
    ("bf16+ac", GPT, 2, ["ddp", "zero3", "fsdp", "torch-fsdp", "torch-ddp"],
     ["train.precision=bf16", "parallel.mixed_precision=bf16", "train.activation_checkpointing=true"]),
    ("hsdp", GPT, 4, ["fsdp", "torch-fsdp"], ["parallel.shard_size=2"]),
    ("offload", GPT, 2, ["zero3", "fsdp"], ["parallel.offload=cpu"]),
    ("lora", MISTRAL, 2, ["ddp", "fsdp", "torch-fsdp", "torch-ddp"], ["model.lora.rank=4"]),
    ("one rank, selective", GPT, 1, ["ddp", "fsdp", "torch-fsdp"], ["train.activation_checkpointing=selective"]),
]


def _both_ways(cases: list) -> dict:
    """In one child: each case's engines probed on fake and on real tensors (one depth)."""
    from shardlab.plan.model import engine_config
    from shardlab.plan.probe import probe_child

    out = {}
    for name, (config, base), world, engines, overrides in cases:
        cfg = load_config(config, base + overrides)
        micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
        for fake in (True, False):
            plans = {e: {"raw": engine_config(cfg, e, world, world).to_dict(), "fake": fake, "micro": micro,
                         "seq": seq} for e in engines}
            res = probe_child(plans, world, [2], 2)
            out[name, fake] = {e: r["2"] for e, r in res.items()}
    return out


@pytest.mark.slow
def test_fake_probes_equal_real_probes_to_the_byte():
    from shardlab.plan.model import in_child

    got = in_child(_both_ways, CASES, timeout_s=600)
    for name, _, _, engines, _ in CASES:
        for e in engines:
            fake, real = got[name, True][e], got[name, False][e]
            assert fake["fake"] and not real["fake"]
            for key in ("peak", "fwd_peak", "parts", "fwd_parts", "end_parts", "fwd_end_parts", "phase", "step_flops"):
                assert fake[key] == real[key], (name, e, key, fake[key], real[key])
