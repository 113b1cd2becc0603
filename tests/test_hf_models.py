"""model.name=hf: tiny Mistral and GPT-2 architectures (built here from configs) train identically
with fsdp, zero3 and torch-fsdp as with single over a few SFT steps (masked targets, packed
inputs), load from a sharded safetensors directory on the meta device into the same weights on
every engine, recompute rotary buffers, and with LoRA train only adapters with adapter-sized traffic."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import shardlab  # noqa: E402
from shardlab.models.hf import HFCausalLM  # noqa: E402
from shardlab.testing import run_workers  # noqa: E402
from tests.parity import F64_ATOL, F64_RTOL, assert_parity  # noqa: E402

VOCAB, T, GLOBAL = 61, 12, 8
ENGINES = ("fsdp", "zero3", "torch-fsdp")


def hf_config(arch: str):
    from transformers import GPT2Config, MistralConfig

    if arch == "mistral":
        return MistralConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=False)
    return GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=3, n_positions=32, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": None}


def build(arch: str, device: str, lora: bool = False, hf_path: str | None = None) -> HFCausalLM:
    with torch.device(device):
        return HFCausalLM(hf_config(arch), seed=5, dtype=torch.float64, hf_path=hf_path,
                          lora=LORA if lora else None)


def sft_batch(step: int, packed: bool, vocab: int = VOCAB, T: int = T, rows: int = GLOBAL, seed: int = 100):
    """Random ids; targets are the next tokens with a random-length prompt masked (-100). Packed:
    two examples per row, position ids restarting at the second one."""
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(1, vocab, (rows, T), generator=g)
    y = torch.roll(ids, -1, dims=1)
    prompt = torch.randint(2, T // 2, (rows,), generator=g)
    y[torch.arange(T)[None, :] < prompt[:, None]] = -100
    y[:, -1] = -100
    if not packed:
        return ids, y
    cut = torch.randint(3, T - 3, (rows,), generator=g)
    pos = torch.stack([torch.cat([torch.arange(c), torch.arange(T - c)]) for c in cut.tolist()])
    y[torch.arange(T)[None, :] == (cut[:, None] - 1)] = -100  # no target across the boundary
    return torch.stack([ids, pos], dim=1), y


def _adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False)


def reference(arch: str, world: int, packed: bool, lora: bool, steps: int = 3):
    """One process; each step's loss is the mean of the per-rank micro-batch losses (the
    objective the engines train: each rank's loss is the mean over its own target tokens)."""
    model = build(arch, "cpu", lora)
    opt = _adamw(model.parameters())
    b = GLOBAL // world
    losses = []
    for step in range(steps):
        x, y = sft_batch(step, packed)
        opt.zero_grad(set_to_none=True)
        loss = sum(model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for r in range(world)) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, arch: str, strategy: str, packed: bool, lora: bool, steps: int = 3):
    import torch.distributed as dist

    model = shardlab.parallelize(build(arch, "meta", lora), strategy, device="cpu")
    engine = shardlab.engine_of(model)
    opt = _adamw(model.parameters())
    b = GLOBAL // world
    losses = []
    before = engine.comm_stats()
    for step in range(steps):
        x, y = sft_batch(step, packed)
        opt.zero_grad(set_to_none=True)
        loss = model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    after = engine.comm_stats()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reduced = None
    if after is not None:
        kinds = [k for k in after if "reduce" in k]
        reduced = sum(after[k]["payload_bytes"] - (before or {}).get(k, {}).get("payload_bytes", 0) for k in kinds)
    return (losses, shardlab.full_state_dict(model)), trainable, reduced


def _all_runs(rank: int, world: int, cases, saved: dict[str, str], lora_sft_dir: str):
    """Everything that needs two ranks, in one spawn (start-up dominates on small machines)."""
    out = {case: _train(rank, world, *case) for case in cases}
    for arch, path in saved.items():
        out[("load", arch)] = _load_runs(rank, world, path, arch)
        out[("load-lora-offload", arch)] = _load_runs(rank, world, path, arch, strategies=("torch-fsdp",),
                                                      lora=True, offload="cpu")
    out["lora_resume"] = _lora_sft_straight_and_resumed(rank, world, lora_sft_dir)
    from tests.test_chunked_loss import chunked_runs  # here: that module takes sft_batch from this one

    out["chunked"] = chunked_runs(rank, world)  # the chunked loss on every engine at 2 ranks
    return out


# every engine on both architectures; packed and padded batches alternate (each engine sees both)
PARITY_CASES = [(arch, strategy, (i + j) % 2 == 0, False) for i, arch in enumerate(("mistral", "gpt2"))
                for j, strategy in enumerate(ENGINES)]
LORA_CASES = [("mistral", "fsdp", True, True), ("gpt2", "zero3", False, True), ("mistral", "torch-fsdp", False, True)]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Each architecture saved by transformers as a sharded safetensors directory (with an index)."""
    out = {}
    for arch in ("mistral", "gpt2"):
        path = tmp_path_factory.mktemp(arch)
        build(arch, "cpu").hf_model.save_pretrained(path, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").exists()
        out[arch] = str(path)
    return out


@pytest.fixture(scope="module")
def lora_sft_dir(tmp_path_factory):
    """A tiny Mistral config and a small alpaca JSONL file for an SFT run through the training loop."""
    import json

    out = tmp_path_factory.mktemp("lora-sft")
    with open("configs/hf/mistral-tiny.json") as f:
        raw = json.load(f)
    raw.update(vocab_size=256, hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
               head_dim=8, max_position_embeddings=64)
    (out / "tiny.json").write_text(json.dumps(raw))
    (out / "d.jsonl").write_text("".join(
        json.dumps({"instruction": f"add {i} and {i % 7}", "output": f"{i} plus {i % 7} is {i + i % 7}"}) + "\n"
        for i in range(48)))
    return str(out)


@pytest.fixture(scope="module")
def parity_runs(saved_models, lora_sft_dir):
    return run_workers(2, _all_runs, PARITY_CASES + LORA_CASES, saved_models, lora_sft_dir, timeout_s=360)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'packed' if c[2] else 'padded'}")
def test_engines_match_single(parity_runs, case):
    arch, strategy, packed, lora = case
    ref = reference(arch, 2, packed, lora)
    got, _, _ = parity_runs[0][case]
    assert_parity(ref, got, f"{arch}/{strategy}", rtol=F64_RTOL, atol=F64_ATOL)


def test_the_chunked_loss_on_every_engine_at_2_ranks(parity_runs):
    from tests.test_chunked_loss import check_chunked_runs

    check_chunked_runs(parity_runs[0]["chunked"], 2)


@pytest.mark.parametrize("case", LORA_CASES, ids=lambda c: f"lora-{c[0]}-{c[1]}")
def test_lora_trains_only_adapters(parity_runs, case):
    arch, strategy, packed, lora = case
    ref = reference(arch, 2, packed, lora)
    got, trainable, reduced = parity_runs[0][case]
    assert_parity(ref, got, f"lora {arch}/{strategy}")
    start = build(arch, "cpu", lora=True).state_dict()
    for k, v in got[1].items():
        changed = not torch.equal(v, start[k])
        assert changed == ("lora_A" in k or "lora_B" in k), f"{k}: changed={changed}"
    adapters = sum(v.numel() for k, v in start.items() if "lora_" in k)
    assert sum(r[case][1] for r in parity_runs) >= adapters  # every adapter element is held by some rank
    if reduced is not None:  # shardlab's engines count bytes: gradient traffic is adapter-sized
        per_step = reduced / 3
        assert 0 < per_step <= adapters * 8 * 1.5, (per_step, adapters * 8)


# -- loading from a sharded safetensors directory -------------------------------------------------
def _fsdp_reads(engine, inner) -> dict[str, int]:
    """What this fsdp rank read from the files (the reader counts every element it reads) against
    what its shards hold: `held` elements of `tensors` tensors whose longest row has `row` elements."""
    held = tensors = slack = 0
    for g in engine.groups:
        n = g.shard.numel()
        lo = engine.shard_rank * n
        for e in g.entries:
            a, b = max(lo, e.offset), min(lo + n, e.offset + e.numel)
            if a < b:
                held += b - a
                tensors += 1
                slack += 2 * (e.numel // e.shape[0] if len(e.shape) else 1)  # 2 rows of this tensor
    return {"read": inner._reader.elements_read, "held": held, "tensors": tensors, "slack": slack,
            "model": sum(e.numel for g in engine.groups for e in g.entries)}


def _torch_fsdp_reads(engine, inner) -> dict[str, Any]:
    """What this torch-fsdp rank read from the files against the elements its DTensor shards of
    file-backed parameters hold, and whether the tied embeddings are still one parameter."""
    hf = inner.hf_model
    return {"read": inner._reader.elements_read,
            "held": sum(p.to_local().numel() for n, p in inner.named_parameters() if ".lora_" not in n),
            "model": sum(p.numel() for n, p in inner.named_parameters() if ".lora_" not in n),
            "tied": hf.get_output_embeddings().weight is hf.get_input_embeddings().weight,
            "dtensors": all(hasattr(p, "device_mesh") for p in inner.parameters()),
            "offloaded": engine.offload is not None}


def _load_runs(rank: int, world: int, path: str, arch: str, strategies=("fsdp", "zero3", "torch-fsdp", "ddp"),
               lora: bool = False, offload: str | None = None):
    """Each engine built on the meta device and loaded from `path`: (strategy -> (full state,
    rotary buffers)), (strategy -> what its rank read) for the engines that read by range."""
    out, reads = {}, {}
    for strategy in strategies:
        options = {"offload": offload} if offload else {}
        model = shardlab.parallelize(build(arch, "meta", lora=lora, hf_path=path), strategy, device="cpu", **options)
        engine = shardlab.engine_of(model)
        inner = engine.unwrapped()
        buffers = {k: v.clone() for k, v in inner.named_buffers() if "inv_freq" in k}
        out[strategy] = (shardlab.full_state_dict(model), buffers)
        if strategy == "fsdp":
            reads[strategy] = _fsdp_reads(engine, inner)
        elif strategy == "torch-fsdp":
            reads[strategy] = _torch_fsdp_reads(engine, inner)
    return out, reads


def _load_fsdp_only(rank: int, world: int, saved: dict[str, str]):
    return {arch: _load_runs(rank, world, path, arch, strategies=("fsdp",)) for arch, path in saved.items()}


@pytest.fixture(scope="module")
def fsdp_loads_3(saved_models):
    """fsdp at an uneven world size: shards start and end mid-tensor and mid-row."""
    return run_workers(3, _load_fsdp_only, saved_models, timeout_s=180)


def _whole_load(arch: str, path: str) -> dict[str, torch.Tensor]:
    return HFCausalLM(hf_config(arch), seed=99, dtype=torch.float64, hf_path=path).state_dict()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_fsdp_reads_only_its_ranges(saved_models, parity_runs, fsdp_loads_3, arch, world):
    """Each fsdp rank reads from the files only the ranges its shards hold, plus under 2 rows per
    tensor (whole rows are read), and loads the same weights as a whole load in one process."""
    runs = [r[("load", arch)] for r in parity_runs] if world == 2 else [r[arch] for r in fsdp_loads_3]
    expected = _whole_load(arch, saved_models[arch])
    for rank, run in enumerate(runs):
        state = run[0]["fsdp"][0]
        assert set(state) == set(expected)
        for k in expected:
            torch.testing.assert_close(state[k], expected[k], rtol=0, atol=0, msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}")
        reads = run[1]["fsdp"]
        assert reads["held"] <= reads["read"] <= reads["held"] + reads["slack"], (rank, reads)
        assert reads["read"] < reads["model"], (rank, reads)  # never the whole model per rank
    held = sum(r[1]["fsdp"]["held"] for r in runs)
    assert held == runs[0][1]["fsdp"]["model"]  # the shards together hold every element once


@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_torch_fsdp_reads_only_its_rows(saved_models, parity_runs, arch):
    """torch-fsdp shards the meta model first, then reads each rank's DTensor rows straight from
    the files: exactly the elements its shards hold (whole rows: no over-read) and less than the
    whole model per rank; the same weights as a whole load; tied embeddings (gpt2) stay one
    parameter. With LoRA and offload=cpu: base weights read the same way, adapters initialized as
    in a whole build, shards on the host."""
    path = saved_models[arch]
    for case, whole in (("load", _whole_load(arch, path)), ("load-lora-offload", build(arch, "cpu", True, path).state_dict())):
        held = 0
        for rank, r in enumerate(parity_runs):
            per_engine, reads = r[(case, arch)]
            state = per_engine["torch-fsdp"][0]
            assert set(state) == set(whole), case
            for k in whole:
                torch.testing.assert_close(state[k], whole[k], rtol=0, atol=0,
                                           msg=lambda m, k=k, c=case, r=rank: f"{c} rank {r} {k}: {m}")
            got = reads["torch-fsdp"]
            assert got["dtensors"] and got["offloaded"] == (case == "load-lora-offload"), (case, rank, got)
            assert got["read"] == got["held"] < got["model"], (case, rank, got)
            assert got["tied"] == (arch == "gpt2"), (case, rank, got)
            held += got["held"]
        assert held == got["model"], case  # the ranks' shards together hold every element once


def test_read_flat_range_reads_only_covering_rows(tmp_path):
    """SafetensorsReader.read_flat_range on a 3-D, a 2-D, a 1-D and a scalar tensor: exactly the
    flat elements asked for, and never more than the covering rows."""
    from safetensors.torch import save_file

    from shardlab.models.hf import SafetensorsReader

    tensors = {"cube": torch.randn(4, 3, 5), "mat": torch.randn(7, 6), "vec": torch.randn(11), "one": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    for key, t in tensors.items():
        flat, row = t.reshape(-1), (t[0].numel() if t.dim() else 1)
        cases = [(0, flat.numel())] + [sorted(torch.randint(0, flat.numel() + 1, (2,), generator=g).tolist())
                                       for _ in range(20)]
        for start, end in cases:
            if start == end:
                continue
            before = reader.elements_read
            got = reader.read_flat_range(key, start, end)
            assert torch.equal(got, flat[start:end]), (key, start, end)
            assert reader.elements_read - before <= (end - start) + 2 * row - 2, (key, start, end)
    with pytest.raises(ValueError, match="beyond"):
        reader.read_flat_range("mat", 40, 43)


@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_load_sharded_safetensors_on_every_engine(saved_models, parity_runs, arch):
    """Built on the meta device, every engine fills its units from the files: the same weights as
    a whole load in one process (and as transformers' from_pretrained), rotary buffers recomputed."""
    from transformers import AutoModelForCausalLM

    path = saved_models[arch]
    whole = HFCausalLM(hf_config(arch), seed=99, dtype=torch.float64, hf_path=path)
    expected = whole.state_dict()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(expected["model." + k], v, rtol=0, atol=0)
    for rank, runs in enumerate(parity_runs):
        per_engine, _reads = runs[("load", arch)]
        for strategy, (state, buffers) in per_engine.items():
            assert set(state) == set(expected), strategy
            for k in expected:
                torch.testing.assert_close(state[k], expected[k], rtol=0, atol=0,
                                           msg=lambda m, k=k, s=strategy, r=rank: f"{s} rank {r} {k}: {m}")
            if arch == "mistral":  # rotary inverse frequencies recomputed, not empty_like garbage
                assert buffers, strategy
                for k, v in buffers.items():
                    want = 1.0 / (10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float) / 6))
                    torch.testing.assert_close(v.float(), want, msg=lambda m, k=k, s=strategy: f"{s} {k}: {m}")


def test_packing_never_mixes_examples():
    """A packed row's logits equal each example's logits computed alone."""
    model = build("mistral", "cpu").eval()
    ids = torch.randint(1, VOCAB, (1, T))
    pos = torch.cat([torch.arange(5), torch.arange(T - 5)])[None]
    packed = model(torch.stack([ids, pos], dim=1))
    alone = torch.cat([model(ids[:, :5]), model(ids[:, 5:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    unpacked = model(ids)
    assert (unpacked[:, 5:] - alone[:, 5:]).abs().max() > 1e-6  # without the mask they would mix


# -- LoRA SFT: checkpoint and resume --------------------------------------------------------------
LORA_SFT_STEPS, LORA_SFT_CRASH = 4, 2


def _lora_sft_cfg(out: str, name: str):
    from shardlab.config import load_config

    return load_config("configs/sft-mistral-tiny.yaml", [
        f"model.hf_config={out}/tiny.json", "model.lora.rank=2", "model.lora.alpha=4.0",
        "model.lora.dropout=0.1",  # the resumed run must restore the RNG to draw the same masks
        f"data.path={out}/d.jsonl", "data.seq_len=64", "data.val_fraction=0.1",
        f"train.steps={LORA_SFT_STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.lr=3e-2",
        "train.warmup_steps=1", "train.eval_batches=1", f"checkpoint.every_steps={LORA_SFT_CRASH}",
        "checkpoint.keep_last=3", "export.format=none", "train.memory_tracking=none", "parallel.strategy=fsdp",
        "parallel.timeout_s=60", f"output.dir={out}", f"output.run_name={name}", "output.progress=false",
        "output.tensorboard=false"])


def _lora_sft_straight_and_resumed(rank: int, world: int, out: str) -> dict:
    """The SFT training loop with LoRA on fsdp: LORA_SFT_STEPS straight, and the same run dying
    right after its step-LORA_SFT_CRASH checkpoint, then started again (resume=auto)."""
    import os

    from shardlab.loop import train as T
    from tests.checkpoint_helpers import runtime, train_until_crash

    os.environ["SHARDLAB_CACHE"] = os.path.join(out, "cache")  # the tokenizer and token cache stay here
    rt = runtime(rank, world, "fsdp")
    straight = T.train(_lora_sft_cfg(out, "straight"), rt)
    train_until_crash(_lora_sft_cfg(out, "resumed"), rt, crash_after=LORA_SFT_CRASH)
    resumed = T.train(_lora_sft_cfg(out, "resumed"), rt)
    return {"straight": straight["losses"], "resumed": resumed["losses"], "steps_this_run": resumed["steps_this_run"]}


def test_lora_sft_resume_matches_uninterrupted(parity_runs, lora_sft_dir):
    """A LoRA SFT run on fsdp (2 ranks) checkpointed, killed and resumed gives the uninterrupted
    run's losses and, bitwise, its adapters, base weights and optimizer state."""
    import os

    from shardlab.checkpoint import read_tensors
    from tests.checkpoint_helpers import assert_same_tensors

    r = parity_runs[0]["lora_resume"]
    assert r["steps_this_run"] == LORA_SFT_STEPS - LORA_SFT_CRASH
    assert len(r["straight"]) == LORA_SFT_STEPS and r["resumed"] == r["straight"]

    def step(run: str, s: int) -> str:
        return os.path.join(lora_sft_dir, run, "checkpoints", f"step_{s:08d}")

    assert assert_same_tensors(step("straight", LORA_SFT_STEPS), step("resumed", LORA_SFT_STEPS)) > 0
    # the run trained the adapters (and only them), and the optimizer holds state for them alone
    early, late = read_tensors(step("straight", LORA_SFT_CRASH)), read_tensors(step("straight", LORA_SFT_STEPS))
    adapters = [k for k in late if k.startswith("model/") and ".lora_" in k]
    assert adapters and all(not torch.equal(early[k], late[k]) for k in adapters)
    assert all(torch.equal(early[k], late[k]) for k in late if k.startswith("model/") and ".lora_" not in k)
    optim = {k.split("/")[1] for k in late if k.startswith("optim/")}
    assert optim == {k.removeprefix("model/") for k in adapters}
