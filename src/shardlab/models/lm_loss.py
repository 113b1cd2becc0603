"""A language model's loss head: the mean cross-entropy of the output projection's logits over the
targets that are not IGNORE_INDEX, computed from the final hidden states either whole ("full":
the logits of every token at once) or in chunks that never hold the whole logits ("chunked").
`train.loss` chooses (auto | chunked | full, docs/training.md); each model family decides what
`auto` means for it and when it cannot chunk (`choose_loss`, called by the model's `use_loss`).

[Note: the chunked loss]
The full loss holds, at the start of backward, the logits (tokens x vocabulary) in the compute
dtype, their float32 upcast, the log-softmax and then its gradient: at a 128,256 vocabulary and
16,384 tokens per micro batch about 24 GiB, more than the model's own shard (docs/memory.md). The
chunked loss gives the same loss and gradients (float64: 1e-10 relative, tests/test_chunked_loss.py)
holding one chunk of logits at a time, of as many bytes as the hidden states (at least 32 MiB of
float32): `chunk_elements`.

- float32 and float64 hidden states: torch's own `F.linear_cross_entropy` (torch >= 2.13; before it,
  `_ChunkedCE` below, as for low precision) with
  `LinearCrossEntropyOptions` (its chunked path), reduction "sum" divided by the target count here
  (its "mean" divides by a count of zero in the gradient too: a micro batch without targets would
  send NaN gradients, where the loop's weighting expects zeros, loss.py). It computes the
  gradients in the forward, in the input dtype, and scales them in backward; its matmuls run
  inside one custom operator, whose FLOPs plan counts by a formula (plan/probe.py).
- bfloat16 and float16 (autocast, or an engine's low-precision parameters): `_ChunkedCE` below.
  Measured (2026-11-26, this 2-core VM, 4,096 tokens, width 256, vocabulary 32,000, against
  float64: `python -m tests.chunked_loss_measure precision`) torch's op falls short there in five ways: (1) its scalar loss accumulates in the
  input dtype: bf16 loss 13.4375 for 13.2296 (1.6e-2 relative; the full loss, upcast: 9.3e-6);
  (2) it computes the gradients in the forward, before fp16's loss scaler multiplies them, so
  small gradients underflow there (1/tokens is below fp16's normal range from 16,384 tokens);
  (3) it accumulates the weight's gradient over row chunks in bf16 (1.35e-2 relative against the
  full loss's 5.5e-3); (4) it picks its precision policy by the device it runs on: on CPU
  ("accurate") it keeps a vocabulary x width float32 scratch that the GPU policy ("compact") does
  not, 2 GiB at Llama 3.1 8B's head, which plan's CPU probes would count as the GPU's; (5) its
  chunk buffers live inside a custom operator whose fake kernel allocates only the outputs, so
  the memory tracker and plan's fake probes do not see them (for float32 that is one chunk,
  about the hidden states' bytes, beside a peak it does see: torch.profiler measured it).
  `_ChunkedCE` computes as the full loss does under the float32 upcast rule: each chunk's logits
  by a matmul in the compute dtype, upcast to float32 for the softmax, the loss summed in
  float32; the logits' gradient (float32) cast to the compute dtype for the two matmuls of
  backward. The forward keeps only each row's log-sum-exp; backward recomputes the logits, by
  vocabulary chunks over all tokens, so each row of the weight's gradient comes from one matmul
  (rounded once, as in the full loss) and the hidden states' gradient accumulates in float32.
  Measured as above: loss 9.3e-6, hidden states' gradient 6.6e-3, weight's 5.5e-3, as the full
  loss's. Cost: one more head matmul than the full loss (4 instead of 3).

What a family does between its hidden states and its logits is applied when it is a scale
(`scale`: Cohere's logit_scale, Granite's 1 / logits_scaling); anything else (Gemma 2's final
soft-capping, a sliced vocabulary) makes the family use the full loss, said once (`announce`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LOSS_MODES = ("auto", "chunked", "full")
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: the smallest chunk, in logits elements (32 MiB of float32): below it the chunks' matmuls are too thin to
#: run well (each chunk of torch's op adds into the whole weight gradient: on this VM's CPU, 2,048 tokens of
#: width 256 and a 32,000 vocabulary, 32-row chunks ran the head 1.15x as long as the full loss, 256-row 0.8x)
MIN_CHUNK_ELEMENTS = 2**23
#: torch's own chunked cross-entropy (F.linear_cross_entropy, torch 2.13): an older torch (the range
#: pyproject allows; a GPU image's build) computes float32/float64 by `_ChunkedCE` too, which gives the
#: same loss and gradients (tests/test_chunked_loss.py runs both)
TORCH_CHUNKED_CE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def choose_loss(requested: str, vocab: int, width: int, problem: str | None) -> tuple[str, str | None]:
    """(the loss a model computes, a line to say once or None). auto: chunked where the vocabulary is
    larger than the model width (the logits outgrow the hidden states), full otherwise; `problem`
    (why this family's head cannot be chunked exactly) makes it full."""
    if requested == "full":
        return "full", None
    if problem is not None:
        wanted = requested == "chunked" or vocab > width
        return "full", (f"train.loss={requested}: the full loss instead: {problem}" if wanted else None)
    if requested == "chunked" or vocab > width:
        return "chunked", None
    return "full", None


_ANNOUNCED: set[str] = set()


def announce(line: str | None) -> None:
    """Print `line` once per process, on rank 0 only (torchrun's RANK; a process outside it is rank 0)."""
    if line is None or line in _ANNOUNCED or os.environ.get("RANK", "0") != "0":
        return
    _ANNOUNCED.add(line)
    print(f"shardlab: {line}", flush=True)


def full_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over the targets != IGNORE_INDEX, in at least float32 (low-precision
    logits are upcast, float64 ones stay)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                 bias: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """`full_loss` of the logits `(hidden @ weight.T + bias) * scale`, never holding them whole:
    [Note: the chunked loss]. NaN when no target counts, as the full loss."""
    h, y = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    h, weight, bias = _as_autocast_would(h, weight, bias)
    if h.dtype in LOW_PRECISION or not TORCH_CHUNKED_CE:
        total = _ChunkedCE.apply(h, weight, bias, y, scale)
    else:
        if scale != 1.0:  # (h W^T + b) s = (s h) W^T + s b
            h, bias = h * scale, (bias * scale if bias is not None else None)
        rows = max(1, chunk_elements(h) // weight.shape[0])
        options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=rows)
        total = F.linear_cross_entropy(h, weight, y, linear_bias=bias, reduction="sum", ignore_index=IGNORE_INDEX,
                                       options=options)
    n = (y != IGNORE_INDEX).sum()
    # where, not a division by zero: its backward sends zeros, not NaN, into a micro batch without targets
    return torch.where(n > 0, total / n.clamp(min=1), torch.nan)


def chunk_elements(h: torch.Tensor) -> int:
    """Logits elements per chunk: as many bytes of float32 (float64) logits as the hidden states hold."""
    acc = torch.promote_types(h.dtype, torch.float32).itemsize
    return max(MIN_CHUNK_ELEMENTS, h.numel() * h.element_size() // acc)


def _as_autocast_would(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The operands in the dtype autocast gives F.linear: its float32 inputs cast to the autocast
    dtype, so the chunked loss computes in the dtype the full loss's logits would have."""
    device = h.device.type
    if not torch.is_autocast_enabled(device):
        return h, weight, bias
    dtype = torch.get_autocast_dtype(device)
    cast = [t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in (h, weight, bias)]
    return cast[0], cast[1], cast[2]


class _ChunkedCE(torch.autograd.Function):
    """The summed cross-entropy of (h @ w.T + b) * scale over rows whose target is not IGNORE_INDEX,
    for low-precision h and w: [Note: the chunked loss]. Forward by row chunks (keeping each row's
    log-sum-exp), backward by vocabulary chunks."""

    @staticmethod
    def forward(ctx, h, w, b, y, scale):
        keep = y != IGNORE_INDEX
        y0 = torch.where(keep, y, 0)
        acc = torch.promote_types(h.dtype, torch.float32)  # float32; float64 for the exactness tests
        lse = torch.empty(h.shape[0], dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        rows = max(1, chunk_elements(h) // w.shape[0])
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                z = _logits(h[s:s + rows], w, b, scale, 0, w.shape[0])
                picked = z.gather(1, y0[s:s + rows, None]).squeeze(1)
                top = z.amax(1, keepdim=True)
                lse[s:s + rows] = z.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))
                total += torch.where(keep[s:s + rows], lse[s:s + rows] - picked, 0).sum()
        ctx.save_for_backward(h, w, b, y0, keep, lse)
        ctx.scale = scale
        return total

    @staticmethod
    def backward(ctx, grad):
        h, w, b, y0, keep, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # d total / d z = (softmax(z) - onehot(y)) * scale on the kept rows, times the incoming grad
        coef = (grad.to(lse.dtype) * ctx.scale * keep)[:, None]
        gh = torch.zeros(h.shape, dtype=lse.dtype, device=h.device) if need_h else None
        gw = torch.empty_like(w) if need_w else None
        gb = torch.empty_like(b) if need_b else None
        cols = max(1, chunk_elements(h) // h.shape[0])
        with torch.autocast(h.device.type, enabled=False):
            for v in range(0, w.shape[0], cols):
                z = _logits(h, w, b, ctx.scale, v, v + cols)
                p = z.sub_(lse[:, None]).exp_()
                hit = ((y0 >= v) & (y0 < v + cols)).to(p.dtype)[:, None]
                p.scatter_add_(1, (y0 - v).clamp(0, p.shape[1] - 1)[:, None], -hit)
                d = p.mul_(coef).to(h.dtype)
                if need_w:
                    torch.mm(d.t(), h, out=gw[v:v + cols])
                if need_h:
                    gh += torch.mm(d, w[v:v + cols])
                if need_b:
                    gb[v:v + cols] = p.sum(0).to(b.dtype)
        return (gh.to(h.dtype) if need_h else None), gw, gb, None, None


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, scale: float, v0: int, v1: int) -> torch.Tensor:
    """Logits of vocabulary rows [v0, v1) in at least float32: the matmul in the compute dtype, then
    upcast (the full loss's rule), then the family's scale."""
    z = torch.mm(h, w[v0:v1].t())
    if b is not None:
        z += b[v0:v1]
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.mul_(scale) if scale != 1.0 else z
