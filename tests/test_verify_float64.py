"""verify's float64 end to end (verify/float64.py, [Note: float32 islands in a float64 run]):
the cause of the 3-rank false alarm on Hugging Face decoders, the mode that removes it, and what
is still seen and named when a module computes in float32 anyway. No processes here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.verify.float64 import Float64Everywhere


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def _grads_of_scaled_loss(model, ids, scale: float) -> torch.Tensor:
    """The gradients of (scale x loss) divided back by scale: what a rank's weighting by N n / G
    and the engine's averaging over N do to one micro batch."""
    model.zero_grad(set_to_none=True)
    (model(input_ids=ids, labels=ids).loss * scale).backward()
    return torch.cat([p.grad.reshape(-1) / scale for p in model.parameters()])


def test_float32_island_is_why_three_ranks_differed():
    """transformers' RMSNorm computes in float32 inside a float64 model: scaling the loss by 2 or 4
    (2 and 4 ranks) rounds exactly as unscaled, by 3 it does not. Under the mode it is float64."""
    model, ids = _llama(), torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    plain = _grads_of_scaled_loss(model, ids, 1.0)
    for scale in (2.0, 4.0):
        assert torch.equal(_grads_of_scaled_loss(model, ids, scale), plain)
    by3 = _grads_of_scaled_loss(model, ids, 3.0)
    assert (by3 - plain).norm() / plain.norm() > 1e-10  # float32 rounding (measured ~1e-8), not float64's
    with Float64Everywhere() as mode:
        plain64 = _grads_of_scaled_loss(model, ids, 1.0)
        by3_64 = _grads_of_scaled_loss(model, ids, 3.0)
    assert (by3_64 - plain64).norm() / plain64.norm() < 1e-14
    assert any(site.startswith("LlamaRMSNorm: to(torch.float32)") for site in mode.kept), mode.kept
    assert any(site.startswith("LlamaAttention: softmax") for site in mode.kept), mode.kept
    assert not mode.islands


def test_mode_keeps_every_downcast_form_in_float64():
    x, f32 = torch.randn(3, dtype=torch.float64), torch.zeros(1)
    with Float64Everywhere() as mode:
        outs = [x.float(), x.half(), x.bfloat16(), x.to(torch.float32), x.to("cpu", torch.float32),
                x.to(dtype=torch.float32), x.to(f32), x.type_as(f32), torch.softmax(x, 0, dtype=torch.float32),
                x.sum(dtype=torch.float32)]
        untouched = [torch.arange(3).float(), torch.ones(2, dtype=torch.float32).to(torch.float16)]
    assert all(o.dtype == torch.float64 for o in outs)
    assert [u.dtype for u in untouched] == [torch.float32, torch.float16]  # not a float64 value: left alone
    assert sum(mode.kept.values()) == len(outs) and not mode.islands
    assert torch.equal(outs[0], x)


class CopiesIntoFloat32(nn.Module):
    """A module whose float32 island the mode cannot rewrite: an in-place copy into a float32 buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        staging = torch.empty(x.shape, dtype=torch.float32)
        staging.copy_(x)
        return staging.double() * self.w


def test_an_island_the_mode_cannot_remove_is_named():
    with Float64Everywhere() as mode:
        CopiesIntoFloat32()(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert any(site.startswith("CopiesIntoFloat32: copy_") for site in mode.islands), mode.islands
    assert mode.summary()["island_dtypes"] == ["float32"]


def test_an_island_sets_the_tolerance_from_its_dtype():
    from types import SimpleNamespace

    from shardlab.verify.tolerance import tolerance_for

    plan = SimpleNamespace(dtype="float64", engine={})
    meta = {"initial": {"w": torch.zeros(4, dtype=torch.float64)}, "num_parameters": 10_000}
    assert tolerance_for(plan, meta, 1e-16).dtype_name == "float64"
    with_island = tolerance_for(plan, meta, 1e-16, torch.float32)
    assert with_island.dtype_name == "float32" and with_island.value == pytest.approx(1000 * 2.0**-24 * 100)
