"""train.loss=chunked (models/lm_loss.py, [Note: the chunked loss]) gives the full loss's loss and
gradients: in float64 to 1e-10 relative (tests/parity.py's tolerance, many orders above float64's
rounding), for our GPT (tied head), an HF Llama (untied), an HF Qwen2 with tied embeddings, a Cohere
and a Granite (a scale between head and logits), LoRA on and off, packed rows and padded ones, in one
process and on every engine at 2 and 3 ranks; the chunk floor is lowered so that every case runs
several chunks. The runs at 2 and 3 ranks share the spawns of tests/test_hf_models.py and
tests/test_hf_parity_3ranks.py (`chunked_runs`, `check_chunked_runs` here): start-up dominates a spawn.
In bf16 and fp16 it is as precise as the full loss (against float64, within a factor 2 of the full
loss's own error). A family it cannot follow keeps the full loss and says why; train.loss=chunked on a
model without an output projection is a one-line config error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import shardlab  # noqa: E402
from shardlab.config import ConfigError, load_config  # noqa: E402
from shardlab.models import GPT, GPTConfig, lm_loss  # noqa: E402
from shardlab.models.hf import HFCausalLM  # noqa: E402
from shardlab.verify.float64 import Float64Everywhere  # noqa: E402
from tests.hf_families import COMMON, FAMILIES  # noqa: E402
from tests.parity import F64_ATOL, F64_RTOL, assert_parity, micro_batch_sgd  # noqa: E402
from tests.test_hf_models import sft_batch  # noqa: E402

VOCAB, T, MICRO, STEPS = 53, 10, 2, 2
GLOBAL = 12  # 2 ranks: 3 micro batches each, 3 ranks: 2
ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
HF = {"llama": ("llama", dict(tie_word_embeddings=False)), "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
      "cohere": ("cohere", FAMILIES["cohere"].config), "granite": ("granite", FAMILIES["granite"].config)}


def build(arch: str, device: str = "cpu", lora: bool = False, loss: str = "full"):
    """A float64 model of `arch` (gpt or a key of HF) with `loss` (use_loss) on `device`."""
    from transformers import AutoConfig

    with torch.device(device):
        if arch == "gpt":
            model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=3, n_embd=24), seed=3).double()
        else:
            family, keys = HF[arch]
            config = AutoConfig.for_model(family, **{**COMMON, **keys, "vocab_size": VOCAB, "hidden_size": 24,
                                                     "max_position_embeddings": 32})
            model = HFCausalLM(config, seed=3, dtype=torch.float64, lora=LORA if lora else None)
    assert model.use_loss(loss) is None and model.loss == loss
    return model


def batch(step: int, packed: bool):
    return sft_batch(step, packed, vocab=VOCAB, T=T, rows=GLOBAL, seed=300)


@pytest.fixture(autouse=True)
def several_chunks(monkeypatch):
    monkeypatch.setattr(lm_loss, "MIN_CHUNK_ELEMENTS", 1)  # 20 tokens x width 24: 3 chunks of rows, 3 of vocabulary


def _loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


ONE_PROCESS = [("gpt", False, False)] + [(a, p, lo) for a in ("llama", "qwen2-tied") for p in (False, True)
                                          for lo in (False, True)] + [("cohere", True, False), ("granite", False, True)]


@pytest.mark.parametrize("arch,packed,lora", ONE_PROCESS)
def test_chunked_gives_the_full_loss_and_every_gradient(arch, packed, lora):
    x, y = batch(0, packed and arch != "gpt")
    with Float64Everywhere():  # transformers' float32 norms would round both to 6e-8 (verify/float64.py)
        full = _loss_and_grads(build(arch, lora=lora), x, y)
        chunked = _loss_and_grads(build(arch, lora=lora, loss="chunked"), x, y)
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-10, atol=0)
    assert set(chunked[1]) == set(full[1]) and (not lora or all(".lora_" in n for n in full[1]))
    for name, g in full[1].items():
        torch.testing.assert_close(chunked[1][name], g, rtol=1e-10, atol=1e-10 * g.abs().max().item(),
                                   msg=lambda m, name=name: f"{arch}: gradient of {name}\n{m}")


def test_own_chunked_function_in_float64_with_bias_scale_and_ignored_rows():
    """The bf16/fp16 path (`_ChunkedCE`) is dtype-generic: in float64 it equals the full loss, bias and
    a family's scale included; rows without a target give nothing."""
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in ((40, 24), (53, 24), (53,)))
    y = torch.randint(0, 53, (40,), generator=g)
    y[::3] = lm_loss.IGNORE_INDEX
    want = torch.nn.functional.cross_entropy((h @ w.T + b) * 0.3, y, reduction="sum")
    got = lm_loss._ChunkedCE.apply(h, w, b, y, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, e in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12 * e.abs().max().item())


@pytest.mark.parametrize("torch_op", [True, False], ids=["torch-op", "older-torch"])
def test_chunked_loss_in_float64_on_either_path(torch_op, monkeypatch):
    """float32/float64 use torch's F.linear_cross_entropy where torch has it (2.13) and `_ChunkedCE` on
    an older torch (a GPU image's build): both give the full loss and its gradients."""
    if torch_op and not lm_loss.TORCH_CHUNKED_CE:
        pytest.skip("this torch has no F.linear_cross_entropy")
    monkeypatch.setattr(lm_loss, "TORCH_CHUNKED_CE", torch_op)
    g = torch.Generator().manual_seed(1)
    h, w = (torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in ((40, 24), (53, 24)))
    y = torch.randint(0, 53, (40,), generator=g)
    y[::4] = lm_loss.IGNORE_INDEX
    want = lm_loss.full_loss(h @ w.T, y)
    got = lm_loss.chunked_loss(h, w, y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, e in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12 * e.abs().max().item())


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_low_precision_is_as_precise_as_the_full_loss(low):
    """Under autocast the chunked loss computes as the full loss does (matmuls in the low dtype, softmax
    and loss in float32): against float64, its loss and gradients are off by at most twice what the full
    loss's are."""
    from shardlab.loop.loss import autocast

    x, y = batch(1, False)
    ref = _loss_and_grads(build("gpt"), x, y)
    errors = {}
    for loss in ("full", "chunked"):
        model = build("gpt", loss=loss).float()
        with autocast(low, torch.device("cpu")):
            got = _loss_and_grads(model, x, y)
        assert got[0].dtype == torch.float32
        errors[loss] = [abs(got[0].item() - ref[0].item()) / ref[0].item()] + [
            ((got[1][n].double() - g).norm() / g.norm()).item() for n, g in ref[1].items()]
    assert max(errors["chunked"]) <= 2 * max(errors["full"]), errors


def test_no_target_gives_nan_loss_and_zero_gradients_on_both_paths():
    """A micro batch without targets: NaN loss (the full loss's) and, through the loop's weighting
    (loss.py: nan_to_num * 0), zero gradients, not NaN ones."""
    for dtype in (torch.float64, torch.bfloat16):
        h = torch.randn(6, 24, dtype=dtype, requires_grad=True)
        w = torch.randn(53, 24, dtype=dtype, requires_grad=True)
        loss = lm_loss.chunked_loss(h, w, torch.full((6,), lm_loss.IGNORE_INDEX))
        (loss.nan_to_num() * 0).backward()
        assert loss.isnan() and h.grad.eq(0).all() and w.grad.eq(0).all()


def test_a_family_it_cannot_follow_keeps_the_full_loss_and_says_why():
    from transformers import AutoConfig

    fam = FAMILIES["gemma2"]
    with torch.device("meta"):
        model = HFCausalLM(AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.config}), attention="eager")
    note = model.use_loss("chunked")
    assert model.loss == "full" and "final_logit_softcapping=2.0" in note and note.startswith("train.loss=chunked")
    assert model.use_loss("full") is None


def test_auto_chunks_where_the_vocabulary_outgrows_the_width():
    assert lm_loss.choose_loss("auto", 53, 24, None) == ("chunked", None)
    assert lm_loss.choose_loss("auto", 24, 24, None) == ("full", None)
    assert lm_loss.choose_loss("auto", 24, 24, "soft-capping") == ("full", None)  # nothing lost: nothing said


def test_config_refuses_chunked_without_an_output_projection():
    for bad, key in ((["model.name=resnet", "data.source=synthetic", "train.loss=chunked"], "train.loss=chunked"),
                     (["train.loss=chunky"], "train.loss: unknown value 'chunky'")):
        with pytest.raises(ConfigError) as e:
            load_config(None, bad)
        assert str(e.value).startswith(key) and "\n" not in str(e.value)
    assert load_config(None, ["model.name=mlp", "data.source=synthetic", "train.loss=auto"]).train.loss == "auto"


# -- every engine at 2 and 3 ranks ---------------------------------------------------------------
# each engine on each model; packing and LoRA alternate so that each HF model meets every combination
DIST_CASES = [("gpt", s, False, False) for s in ENGINES] + [
    (arch, s, (i + j) % 2 == 0, (i + j // 2) % 2 == 0) for j, s in enumerate(ENGINES)
    for i, arch in enumerate(("llama", "qwen2-tied"))]


def reference(arch: str, packed: bool, lora: bool):
    """One process with the full loss (tests/parity.py's micro_batch_sgd: the objective the engines train)."""
    with Float64Everywhere():
        return micro_batch_sgd(build(arch, lora=lora), lambda step: batch(step, packed), STEPS, MICRO, GLOBAL)


def _train(rank: int, world: int, arch: str, strategy: str, packed: bool, lora: bool):
    with Float64Everywhere():
        model = shardlab.parallelize(build(arch, "meta", lora, loss="chunked"), strategy, device="cpu")
        return micro_batch_sgd(model, lambda step: batch(step, packed), STEPS, MICRO, GLOBAL, rank, world)


def chunked_runs(rank: int, world: int) -> dict:
    """Every DIST_CASES run at this rank (in the spawns of tests/test_hf_models.py and
    tests/test_hf_parity_3ranks.py)."""
    floor, lm_loss.MIN_CHUNK_ELEMENTS = lm_loss.MIN_CHUNK_ELEMENTS, 1  # several chunks here too
    try:
        return {case: _train(rank, world, *case) for case in DIST_CASES}
    finally:
        lm_loss.MIN_CHUNK_ELEMENTS = floor


def check_chunked_runs(got: dict, world: int) -> None:
    """Each engine with the chunked loss trains as one process with the full loss (float64, 1e-10)."""
    for case in DIST_CASES:
        arch, strategy, packed, lora = case
        label = f"{arch}/{strategy}/N={world}{'/packed' if packed else ''}{'/lora' if lora else ''}"
        assert_parity(reference(arch, packed, lora), got[case], label, rtol=F64_RTOL, atol=F64_ATOL)


def test_the_cases_cover_every_combination():
    combos = {(arch, packed, lora) for arch, _, packed, lora in DIST_CASES if arch != "gpt"}
    assert len(combos) == 8 and {s for _, s, _, _ in DIST_CASES} == set(ENGINES)


def test_plan_offers_the_chunked_loss_first_when_the_full_one_does_not_fit():
    """plan probes train.loss=chunked beside a config that asks for the full loss of a model whose auto
    would chunk (plan/predict.py); cheapest_change names it before any other change."""
    from shardlab.plan.model import chunked_instead
    from shardlab.plan.predict import Prediction
    from shardlab.plan.report import cheapest_change

    gib, tiny = 2**30, "configs/gpt-tiny.yaml"  # vocabulary 256 > width 128
    assert chunked_instead(load_config(tiny, ["train.loss=full"]))
    assert not chunked_instead(load_config(tiny, ["train.loss=auto"]))
    assert not chunked_instead(load_config(tiny, ["train.loss=full", "model.n_embd=256", "model.n_head=4"]))
    assert not chunked_instead(load_config(None, ["model.name=mlp", "data.source=synthetic", "train.loss=full"]))
    cfg = load_config(tiny, ["train.loss=full"])
    parts = dict.fromkeys(("params", "grads", "optimizer", "gathered_params", "unsharded_grads", "comm", "other"), 0)
    full = Prediction("fsdp", 2, 12 * gib, {**parts, "activations": 12 * gib}, "backward", {},
                      alternatives={"train.loss=chunked": 7 * gib})
    other = Prediction("zero3", 2, 9 * gib, {**parts, "activations": 9 * gib}, "backward", {})
    assert cheapest_change(cfg, full, 10 * gib, {"fsdp": full, "zero3": other}, 2) == "train.loss=chunked (7.00 GiB)"
    assert cheapest_change(cfg, full, 6 * gib, {"fsdp": full}, 2) != "train.loss=chunked (7.00 GiB)"
