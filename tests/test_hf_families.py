"""The family sweep: every decoder family of tests/hf_families.py, written as a Hugging Face
directory (tiny random weights, its own tokenizer and chat template) and loaded by shardlab as
training loads it (`build_model` on the meta device, materialized by an engine), in float64:

(1) every parameter and buffer of shardlab's build (`single`, and `fsdp` at world size 1) equals
    `AutoModelForCausalLM.from_pretrained(dir)`'s, bit for bit and dtype for dtype;
(2) under every attention implementation the catalogue lists for the family (eager, sdpa):
    changing the other examples of a packed row moves no logit of an example, and its logits
    equal those it gets alone;
(3) shardlab's loss over the rows (packed and padded) equals transformers' over the same rows:
    the float64 cross-entropy of transformers' own logits to 1e-12, and transformers' `.loss` to
    float32's precision (its ForCausalLMLoss upcasts the logits with `.float()`, so in a float64
    model its `.loss` carries float32 rounding);
(6) shardlab's HF export (after a training step) loaded by plain transformers gives the same logits,
    and (8) so does shardlab's own reading of it (`load_hf_dir`: eval, generate);
(7) mixtures of experts (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3) are written in the
    Hub's per-expert layout and loaded through transformers' converters; where the family has a
    router loss it is on (output_router_logits), and (3) holds with it: transformers' `.loss`.
(4) verify at 3 ranks and (5) trained ids == apply_chat_template ids are hooks in the catalogue.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import shardlab  # noqa: E402
from shardlab.models.hf_load import POSITION_IDS, packed_mask  # noqa: E402
from shardlab.testing import run_workers  # noqa: E402
from shardlab.verify.float64 import Float64Everywhere  # noqa: E402
from tests.hf_families import FAMILIES, SKIPPED  # noqa: E402

NAMES = [n for n in FAMILIES if n not in SKIPPED]
EXAMPLE_LENGTHS = (6, 4, 7)  # longer than the sliding windows (5) of the families that have one
T = 20                        # the packed row: the three examples, then 3 padding tokens


def section(path: str, dtype: str = "fp64", attention: str | None = None):
    from shardlab.models.hf import LoRAKeys

    return SimpleNamespace(name="hf", hf_path=path, hf_config=None, hf_dtype=dtype, hf_attention=attention,
                           lora=LoRAKeys())


def shardlab_model(path: str, strategy: str = "single", dtype: str = "fp64", attention: str | None = None):
    """The model as `shardlab train` builds it: on the meta device, materialized by the engine."""
    from shardlab.models import build_model

    return shardlab.parallelize(build_model(section(path, dtype, attention), device="meta"), strategy, device="cpu")


def reference(path: str, dtype=torch.float64):
    """transformers' own load of the directory; in float64 with its eager experts (its default
    calls torch._grouped_mm, which has no float64 kernel: [Note: float64 experts] in models/hf_router.py)."""
    from transformers import AutoModelForCausalLM

    eager = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **eager)


def examples(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, targets) per example: targets are the next ids with a prompt masked (-100) and
    nothing after the last token, as SFT rows are."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    out = []
    for n in EXAMPLE_LENGTHS:
        ids = torch.randint(3, 320, (n,), generator=g)
        y = torch.full((n,), -100)
        y[2:-1] = ids[3:]
        out.append((ids, y))
    return out


def packed_row(exs) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 2, T] (ids, position ids restarting per example; padding a segment of its own) and [1, T]."""
    ids = torch.zeros(T, dtype=torch.long)
    pos = torch.zeros(T, dtype=torch.long)
    y = torch.full((T,), -100)
    at = 0
    for x, t in exs:
        ids[at:at + len(x)], y[at:at + len(x)], pos[at:at + len(x)] = x, t, torch.arange(len(x))
        at += len(x)
    pos[at:] = torch.arange(T - at)
    return torch.stack([ids, pos])[None], y[None]


def padded_rows(exs) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(len(exs), T, dtype=torch.long)
    y = torch.full((len(exs), T), -100)
    for i, (ids, t) in enumerate(exs):
        x[i, :len(ids)], y[i, :len(t)] = ids, t
    return x, y


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.hf_families import write_family

    return {n: write_family(n, str(tmp_path_factory.mktemp(n))) for n in NAMES}


def _fsdp_builds(rank: int, world: int, dirs: dict[str, str]):
    out = {}
    for name, path in dirs.items():
        model = shardlab_model(path, "fsdp")
        inner = shardlab.engine_of(model).unwrapped()
        out[name] = (shardlab.full_state_dict(model), {k: v.clone() for k, v in inner.named_buffers()})
    return out


@pytest.fixture(scope="module")
def fsdp_builds(dirs):
    return run_workers(1, _fsdp_builds, dirs, timeout_s=240)[0]


def _tensors(module, prefix: str = "") -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return {k.removeprefix(prefix): v.detach() for k, v in named}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, (what, k, got[k].dtype, v.dtype)
        assert torch.equal(got[k], v), (what, k, (got[k].double() - v.double()).abs().max().item())


@pytest.mark.parametrize("name", NAMES)
def test_build_equals_from_pretrained(dirs, fsdp_builds, name):
    """(1) Every parameter and buffer (non-persistent ones included: rotary frequencies, Gemma's
    embed_scale) of shardlab's meta-device build equals transformers' from_pretrained."""
    want = _tensors(reference(dirs[name]))
    single = shardlab.engine_of(shardlab_model(dirs[name])).unwrapped()
    _assert_same(_tensors(single, "model."), want, "single")
    state, buffers = fsdp_builds[name]
    fsdp = {k.removeprefix("model."): v for k, v in {**state, **buffers}.items()}
    _assert_same(fsdp, want, "fsdp")


# transformers' eager attention computes its softmax in float32 in most families, also in a float64
# model: packed-versus-alone logits under eager then differ by float32's rounding (1.8e-7 to 1.0e-6
# over the families, 2026-11-27). The checks of exactness run under verify's Float64Everywhere
# (verify/float64.py), which keeps those casts in float64, so every implementation is held to 1e-10.
EXACT = 1e-10


def _logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x)[0]


@pytest.mark.parametrize("name,impl", [(n, i) for n in NAMES for i in FAMILIES[n].attention])
def test_packed_examples_are_isolated(dirs, name, impl):
    """(2) Changing the other examples of a packed row moves none of an example's logits, and each
    example's logits equal those it gets alone: <= 1e-10 in float64 end to end."""
    model = shardlab_model(dirs[name], attention=impl)  # model.hf_attention=impl
    inner = shardlab.engine_of(model).unwrapped()
    assert inner.attention == impl
    inner.double()  # every parameter float64, as verify's proof has it (DeepSeek-V3 keeps its router in float32)
    model.eval()
    exs = examples(name)
    x, _ = packed_row(exs)
    mode = Float64Everywhere().__enter__()
    packed = _logits(model, x)
    at = 0
    g = torch.Generator().manual_seed(7)
    for ids, _t in exs:
        n = len(ids)
        others = x.clone()  # every other example (and the padding) replaced by other tokens
        keep = torch.zeros(T, dtype=torch.bool)
        keep[at:at + n] = True
        others[0, 0, ~keep] = torch.randint(3, 320, (int((~keep).sum()),), generator=g)
        moved = (_logits(model, others)[at:at + n] - packed[at:at + n]).abs().max().item()
        assert moved <= EXACT, (name, impl, at, moved)
        alone = (packed[at:at + n] - _logits(model, ids[None])).abs().max().item()
        assert alone <= EXACT, (name, impl, at, alone)
        at += n
    mode.__exit__(None, None, None)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("name", NAMES)
def test_loss_is_transformers_loss(dirs, name, packed):
    """(3) shardlab's training loss (the engine's forward in train mode, token-weighted over the
    rows) equals transformers' on the same rows: packed rows as transformers takes them (position
    ids that restart, no attention mask), padded rows as they are, labels shifted by transformers."""
    model = shardlab_model(dirs[name])
    model.train()
    x, y = packed_row(examples(name)) if packed else padded_rows(examples(name))
    loss = model(x, y).item()
    ref = reference(dirs[name])
    ref.train()
    assert (y[:, -1] == -100).all()  # nothing after the last token: transformers' shift loses no target
    labels = torch.cat([torch.full((y.shape[0], 1), -100), y[:, :-1]], dim=1)
    kwargs = {"input_ids": x[:, 0], "position_ids": x[:, 1]} if packed else {"input_ids": x}
    route = shardlab.engine_of(model).unwrapped().packed_route()
    if packed and route != POSITION_IDS:  # OPT: transformers given shardlab's block-diagonal mask too
        kwargs["attention_mask"] = packed_mask(x[:, 1], route, torch.float64)
    out = ref(**kwargs, labels=labels, use_cache=False)
    ce64 = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1), ignore_index=-100).item()
    if getattr(out, "aux_loss", None) is not None:  # (7) the router's loss, as transformers adds it to .loss
        ce64 += ref.router_aux_loss_coef * out.aux_loss.item()
    assert out.logits.dtype == torch.float64
    assert loss == pytest.approx(ce64, rel=1e-12, abs=0), (name, loss, ce64)
    # transformers' own .loss upcasts the logits with .float(): in a float64 model that rounds to
    # float32 (1e-6 here); with that cast kept in float64 (Float64Everywhere) it is the same loss
    assert loss == pytest.approx(out.loss.item(), rel=1e-6, abs=0), (name, loss, out.loss.item())
    ref.double(), shardlab.engine_of(model).unwrapped().double()  # as verify: DeepSeek-V3's float32 router too
    with Float64Everywhere():
        exact = ref(**kwargs, labels=labels, use_cache=False).loss.item()
        mine = model(x, y).item()
    assert mine == pytest.approx(exact, rel=1e-12, abs=0), (name, mine, exact)


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers(dirs, name, tmp_path):
    """(6) After one training step, shardlab's HF export (`model_from_state` + `export_hf`, as
    `shardlab export --format hf` does) loads in plain transformers with the same logits."""
    from shardlab.export_hf import export_hf, model_from_state
    from shardlab.models import model_record

    model = shardlab_model(dirs[name])
    x, y = packed_row(examples(name))
    model(x, y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.eval()
    record = model_record("hf", shardlab.engine_of(model).unwrapped(), 0)
    out = export_hf(model_from_state(record, shardlab.full_state_dict(model)), str(tmp_path / "hf"),
                    tokenizer_dir=dirs[name])
    hf = reference(out).eval()
    ids = x[:, 0, :10]
    with torch.no_grad():
        got, want = hf(input_ids=ids, use_cache=False).logits, model(ids)
    # the same weights and buffers (test_build_equals_from_pretrained); the logits differ by at most
    # 2.2e-15 here (BLAS on the loaded tensors' other memory), never beyond float64's noise
    assert (got - want).abs().max().item() <= 1e-12, (name, (got - want).abs().max().item())
    # (8) shardlab reads its own export back (`shardlab eval/generate RUN/hf`: load_hf_dir), MoE experts too
    from shardlab.export_hf import load_hf_dir

    with torch.no_grad():
        back = load_hf_dir(out, "fp64")(ids)
    assert (back - got).abs().max().item() <= 1e-12, (name, (back - got).abs().max().item())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_fallback_masks_isolate_and_a_boolean_mask_under_eager_does_not(dirs, impl):
    """A family that did not build packed masks from position ids would get shardlab's 4-D mask in
    the form its implementation takes (additive for eager, boolean for sdpa): examples isolated as
    well. A boolean mask under eager (the former way) is added to the scores as 0/1: examples mix."""
    from shardlab.models.hf_load import ADDITIVE, BOOLEAN, packed_mask

    model = shardlab_model(dirs["llama"], attention=impl)
    inner = shardlab.engine_of(model).unwrapped()
    inner.packs_by_position_ids = False
    assert inner.packed_route() == {"eager": ADDITIVE, "sdpa": BOOLEAN}[impl]
    model.eval()
    exs = examples("llama")
    x, _ = packed_row(exs)
    n0 = len(exs[0][0])
    later = x.clone()
    later[0, 0, n0:] = 5  # every later token changed
    with Float64Everywhere():
        packed = _logits(model, x)
        alone = _logits(model, exs[0][0][None])
        changed = _logits(model, later)
    assert (packed[:n0] - alone[:n0]).abs().max().item() <= EXACT
    assert (changed[:n0] - packed[:n0]).abs().max().item() <= EXACT
    if impl == "eager":
        with torch.no_grad():
            mask = packed_mask(x[:, 1], BOOLEAN, torch.float64)
            a = inner.model(input_ids=x[:, 0], position_ids=x[:, 1], attention_mask=mask, use_cache=False).logits
            b = inner.model(input_ids=later[:, 0], position_ids=x[:, 1], attention_mask=mask, use_cache=False).logits
        assert (a[0, :n0] - b[0, :n0]).abs().max().item() > 1e-3


CONVERSATIONS = [
    [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": "It returns a string."}],
    [{"role": "user", "content": "Add two numbers"}, {"role": "assistant", "content": "Use the + operator."},
     {"role": "user", "content": "and print it"}, {"role": "assistant", "content": "print(a + b)"}],
]


@pytest.mark.parametrize("name", NAMES)
def test_trained_ids_are_apply_chat_template_ids(dirs, name):
    """(5) The ids an SFT run trains on for a chat record are `apply_chat_template(..., tokenize=True)`'s
    for the family's own tokenizer (plain transformers, AutoTokenizer), BOS exactly where the
    template renders it; what is trained is the assistant turns."""
    from transformers import AutoTokenizer

    from shardlab.data.sft import SFTTokenizer
    from tests.hf_families import CHATS

    tok, plain = SFTTokenizer(dirs[name]), AutoTokenizer.from_pretrained(dirs[name])
    for messages in CONVERSATIONS:
        ids, labels = tok.encode_example({"messages": messages})
        assert ids == list(plain.apply_chat_template(messages, tokenize=True)["input_ids"]), name
        assert (ids[0] == tok.bos_id) == CHATS[FAMILIES[name].chat].renders_bos, name
        trained = plain.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
        for m in messages:
            assert (m["content"] in trained) == (m["role"] == "assistant"), (name, trained)


# -- (4) verify at 3 ranks on every family: fsdp with LoRA, ddp full fine-tuning --------------------
VERIFY_MODES = {"fsdp-lora": ("fsdp", 2), "ddp-full": ("ddp", 0)}
# One mode per family, alternating down the catalogue (each mode on twelve families, the MoE converters
# on both: Mixtral's, Qwen3-MoE's and DeepSeek-V3's with LoRA on fsdp, Qwen2-MoE's and OLMoE's with full
# fine-tuning on ddp, the router loss on). Both modes on every family doubled the module's cost for
# engines the rest of the suite already proves on these models (tests/test_hf_models.py,
# tests/test_verify_hf.py).
VERIFIED_MODE = {name: sorted(VERIFY_MODES)[i % 2] for i, name in enumerate(NAMES)}


def _verify_config(name: str, path: str, data: str, strategy: str, lora: int) -> dict:
    from shardlab.models.hf import lora_layer_names

    targets = None  # shardlab's default targets (hf_lora.default_targets)
    if lora and FAMILIES[name].lora_targets == "all":
        targets = sorted(n for n in lora_layer_names(section(path)) if n not in ("lm_head", "embed_out")
                         and "embed" not in n)
    return {"model": {"name": "hf", "hf_path": path, "lora": {"rank": lora, "target_modules": targets}},
            "data": {"source": "sft", "path": data, "seq_len": 48, "packing": True, "val_fraction": 0.0},
            "train": {"global_batch_size": 12, "micro_batch_size": 2, "warmup_steps": 1, "optimizer": "sgd",
                      "momentum": 0.9, "lr": 0.1},
            "parallel": {"strategy": strategy}}


def _verify_all(rank: int, world: int, plans: dict) -> dict:
    from shardlab.loop.runtime import Runtime
    from shardlab.verify.compare import compare
    from shardlab.verify.runs import verify_worker

    rt = Runtime(rank, rank, world, torch.device("cpu"), "gloo")
    out = {}
    for key, plan in plans.items():  # one step: forward, backward, clip and step once each
        # What is alive now (torch, transformers, the families' modules) lives until the worker ends:
        # frozen, it is not walked again by each run's gc.collect (verify/runs.py), 0.2 s per call on
        # this heap, five calls per case over the three ranks: half of a case's CPU (2026-11-28)
        gc.freeze()
        report = verify_worker(rt, plan, compare)
        if report is not None:
            out[key] = (report.equal, report.first, report.cause, report.noise_floor,
                        max(row.worst.error for row in report.rows), report.tolerance.dtype_name)
    return out


@pytest.fixture(scope="module")
def verified(dirs, tmp_path_factory, monkeypatch_module):
    """Every family's verify plan made here, as `shardlab verify --nproc 3 --steps 1` makes it before
    its workers (once, not once per rank), then run by three workers in one spawn."""
    import argparse
    import json

    from shardlab.config import config_from_dict
    from shardlab.verify.command import make_plan

    root = tmp_path_factory.mktemp("verify-families")
    monkeypatch_module.setenv("SHARDLAB_CACHE", str(root / "cache"))
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and {i % 5}"},
                                                     {"role": "assistant", "content": f"It is {i + i % 5}."}]})
                            + "\n" for i in range(48)))
    args = argparse.Namespace(nproc=3, steps=1, against="single", dtype="float64", layers=None, keep_dropout=False)
    plans = {}
    for name, mode in VERIFIED_MODE.items():
        raw = _verify_config(name, dirs[name], str(data), *VERIFY_MODES[mode])
        workdir = root / name / mode
        workdir.mkdir(parents=True)
        plans[f"{name}/{mode}"] = make_plan(config_from_dict(raw), args, str(workdir))
    return run_workers(3, _verify_all, plans, timeout_s=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), sorted(VERIFIED_MODE.items()))
def test_verify_at_3_ranks_is_equal(verified, name, mode):
    """(4) `shardlab verify --nproc 3` (in-process, the same plan and comparison) says EQUAL, in
    float64, with the engine's largest error within 100x the measured noise floor."""
    equal, first, cause, floor, worst, dtype = verified[f"{name}/{mode}"]
    assert equal, (name, mode, first, cause)
    assert dtype == "float64" and worst <= 100 * floor, (name, mode, worst, floor)
