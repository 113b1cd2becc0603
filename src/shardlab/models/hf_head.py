"""What a transformers causal LM does between its decoder's last hidden state and its logits, found
by running the family's own forward on probe values: the chunked loss (models/lm_loss.py) needs the
hidden states, the output projection and that step, and reproduces it only when it is a scale.

[Note: following a family from its hidden states to its logits]
Most families compute `logits = lm_head(hidden_states)`; some then scale them (Cohere `* logit_scale`,
Granite `/ logits_scaling`), soft-cap them (Gemma 2/3 `tanh(logits / cap) * cap`) or slice the
vocabulary. Rather than a list of families and config keys that a new family would slip past, the
causal LM's own forward runs once, at construction, on the meta-built model with its decoder and its
output projection replaced for that call by stand-ins: the decoder returns a known hidden state h, the
projection records what it was given (d * h: a scale before the head) and returns known logits P
(spread over +-1000, where any soft cap bends them). What the forward returns must be c * P for one
number c, in P's shape; the loss then uses the scale c * d. Anything else, or a forward that cannot be
followed this way, is named, and the model keeps the full loss. No weight is read and nothing is
computed at the model's size.
"""

from __future__ import annotations

import torch
from torch import nn

#: config keys that soft-cap the logits, named in the reason when present
SOFT_CAP_KEYS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def head_scale(causal_lm: nn.Module) -> tuple[float, str | None]:
    """(the scale the family applies to `lm_head(hidden)`, None) or (1.0, why the chunked loss
    cannot reproduce its logits): [Note: following a family from its hidden states to its logits]."""
    name = type(causal_lm).__name__
    head = causal_lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return 1.0, f"{name}'s output projection is a {type(head).__name__}, not a Linear (LoRA on it?)"
    vocab, width = head.weight.shape
    with torch.device("cpu"):
        h = torch.linspace(-1.0, 1.0, width, dtype=torch.float64).reshape(1, 1, width)
        p = torch.linspace(-1e3, 1e3, vocab, dtype=torch.float64).reshape(1, 1, vocab)
        seen, out = _run_with_stand_ins(causal_lm, head, h, p)
    if isinstance(out, str):
        return 1.0, f"{name}'s forward could not be followed from its decoder to its logits ({out})"
    d = _scale_of(seen, h) if seen else None
    c = _scale_of(out, p)
    if d is None:
        return 1.0, f"{name} gives its output projection something other than a scale of the decoder's hidden states"
    if c is None:
        capped = [f"{k}={getattr(causal_lm.config, k)}" for k in SOFT_CAP_KEYS
                  if getattr(causal_lm.config, k, None) is not None]
        what = f"soft-capping, {', '.join(capped)}" if capped else f"shape {tuple(p.shape)} -> {tuple(out.shape)}"
        return 1.0, f"{name} applies more than a scale to its logits ({what})"
    return c * d, None


def _run_with_stand_ins(causal_lm: nn.Module, head: nn.Module, h: torch.Tensor, p: torch.Tensor):
    """The causal LM's forward with the decoder returning h and the head recording its input and
    returning p: (the head's inputs, the logits), or an error message in place of the logits."""
    decoder = causal_lm.get_decoder()
    if decoder is head or decoder is causal_lm:
        return [], f"its decoder is not a module of its own ({type(decoder).__name__})"
    seen: list[torch.Tensor] = []

    def stand_in_head(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return p

    decoder.forward = lambda *args, **kwargs: _HiddenOnly(h)
    head.forward = stand_in_head
    try:
        with torch.no_grad():
            out = causal_lm(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False).logits
    except Exception as e:  # any failure means: not followed; the model keeps the full loss
        return seen, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for m in (decoder, head):  # the class's forward again
            vars(m).pop("forward", None)
    return seen, out


class _HiddenOnly:
    """A decoder's output holding only its last hidden state: as a ModelOutput, by name or first in
    order; any other field (past key values, attentions, cross-attentions) is None."""

    def __init__(self, h: torch.Tensor):
        self.last_hidden_state = h

    def __getitem__(self, i):
        return (self.last_hidden_state,)[i]

    def __getattr__(self, name: str):  # only for names not set above
        return None


def _scale_of(got: torch.Tensor | list, want: torch.Tensor) -> float | None:
    """c when `got` is c * `want` (to the rounding of got's dtype), else None."""
    if isinstance(got, list):
        got = got[0]
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.device != want.device \
            or not got.is_floating_point():
        return None
    c = float(got[..., -1].double().item() / want[..., -1].item())
    tol = 4 * torch.finfo(got.dtype).eps
    return c if torch.allclose(got.double(), c * want, rtol=tol, atol=0.0) else None
