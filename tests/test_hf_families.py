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
(6) shardlab's HF export (after a training step) loaded by plain transformers gives the same logits.
(4) verify at 3 ranks and (5) trained ids == apply_chat_template ids are hooks in the catalogue.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import shardlab  # noqa: E402
from shardlab.testing import run_workers  # noqa: E402
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
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


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
# model: a score that differs in its last float64 bit (another matrix shape) can round to another
# float32, so packed-versus-alone logits under eager differ by up to 1.0e-6 here (mistral; 1.8e-7
# to 1.0e-6 over the families, 2026-11-27). EAGER_FP32_FLOOR sits 10x above that; the bug it
# guards against (a boolean mask added to eager's scores as 0/1) moves logits by ~0.1 to 1.
EAGER_FP32_FLOOR = 1e-5
EXACT = 1e-10


def _logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x)[0]


@pytest.mark.parametrize("name,impl", [(n, i) for n in NAMES for i in FAMILIES[n].attention])
def test_packed_examples_are_isolated(dirs, name, impl):
    """(2) Changing the other examples of a packed row moves none of an example's logits (<= 1e-10,
    float64: the same shapes, so no rounding differs), and each example's logits equal those it
    gets alone (<= 1e-10; under eager with a float32 softmax, <= EAGER_FP32_FLOOR)."""
    model = shardlab_model(dirs[name], attention=impl)  # model.hf_attention=impl
    inner = shardlab.engine_of(model).unwrapped()
    assert inner.attention == impl
    model.eval()
    exs = examples(name)
    x, _ = packed_row(exs)
    packed = _logits(model, x)
    floor = EAGER_FP32_FLOOR if impl == "eager" and FAMILIES[name].eager_fp32_softmax else EXACT
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
        assert alone <= floor, (name, impl, at, alone)
        at += n


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
    out = ref(**kwargs, labels=labels, use_cache=False)
    ce64 = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1), ignore_index=-100).item()
    assert out.logits.dtype == torch.float64
    assert loss == pytest.approx(ce64, rel=1e-12, abs=0), (name, loss, ce64)
    assert loss == pytest.approx(out.loss.item(), rel=1e-6, abs=0), (name, loss, out.loss.item())


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
    packed = _logits(model, x)
    n0 = len(exs[0][0])
    floor = EAGER_FP32_FLOOR if impl == "eager" else EXACT
    assert (packed[:n0] - _logits(model, exs[0][0][None])).abs().max().item() <= floor
    later = x.clone()
    later[0, 0, n0:] = 5  # every later token changed
    assert (_logits(model, later)[:n0] - packed[:n0]).abs().max().item() <= EXACT
    if impl == "eager":
        with torch.no_grad():
            mask = packed_mask(x[:, 1], BOOLEAN, torch.float64)
            a = inner.model(input_ids=x[:, 0], position_ids=x[:, 1], attention_mask=mask, use_cache=False).logits
            b = inner.model(input_ids=later[:, 0], position_ids=x[:, 1], attention_mask=mask, use_cache=False).logits
        assert (a[0, :n0] - b[0, :n0]).abs().max().item() > 1e-3
