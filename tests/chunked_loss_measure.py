"""The loss head measured, full against chunked (models/lm_loss.py; docs/memory.md, "The loss head"):

    python -m tests.chunked_loss_measure peak 32000 256             # vocabulary, width
    python -m tests.chunked_loss_measure fake 128256 4096 16384     # Llama 3.1 8B's head at 2 x 8192 tokens
    python -m tests.chunked_loss_measure precision                  # bf16: torch's chunked op against ours

peak: the head's own peak memory, forward and backward, by torch.profiler's memory timeline, which counts
every allocation the CPU allocator sees, the chunk buffers inside torch's chunked operator included (the
live-memory tracker, a dispatch mode, does not see those). The full loss grows with tokens x vocabulary;
the chunked one only with tokens x width and vocabulary x width.
fake: the head under plan's fake tensors (real shapes, no data: plan/probe.py) at one size, in bf16,
measured by the live-memory tracker as plan's probes measure a step: the head's part of a plan at any
size, the inputs (hidden states, weight) left out.
precision: in bf16, the loss and gradients of the full loss (upcast), of torch's chunked operator and of
the chunked loss against float64 ([Note: the chunked loss] quotes them).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from shardlab.models.lm_loss import chunked_loss, full_loss


def peak_bytes(loss, vocab: int, width: int, tokens: int, dtype: torch.dtype) -> int:
    """The largest total of the CPU allocations made while `loss(h, w, y)` runs forward and backward
    (h, w and y, made before, not among them)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, width, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, width, generator=g) * 0.1).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss(h, w, y).backward()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return max(sum(s) for s in sizes)


def fake_head_bytes(loss, vocab: int, width: int, tokens: int, dtype: torch.dtype) -> int:
    """The live-memory tracker's peak of `loss(h, w, y)` forward and backward on fake tensors, less h and w."""
    from shardlab.memory import LiveMemoryTracker
    from shardlab.plan.probe import fake_tensors

    with fake_tensors():
        h = torch.empty(tokens, width, dtype=dtype, requires_grad=True)
        w = torch.empty(vocab, width, dtype=dtype, requires_grad=True)
        y = torch.zeros(tokens, dtype=torch.long)
        tracker = LiveMemoryTracker("cpu", params=[h, w], fake=True)
        with tracker.step(0), tracker.phase("forward"):
            out = loss(h, w, y)
            with tracker.phase("backward"):
                out.backward()
        tracker.close()
    return tracker.summary()["peak_live_bytes"] - (h.numel() + w.numel()) * dtype.itemsize


def main(vocab: int, width: int) -> None:
    losses = {"full": lambda h, w, y: full_loss(h @ w.T, y), "chunked": chunked_loss}
    print(f"vocabulary {vocab}, width {width}: peak MiB of the head's forward and backward")
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (2048, 8192, 32768):
            got = {k: peak_bytes(f, vocab, width, tokens, dtype) / 2**20 for k, f in losses.items()}
            print(f"{str(dtype).removeprefix('torch.'):9s} tokens {tokens:6d}: full {got['full']:8.1f}  chunked "
                  f"{got['chunked']:6.1f}  (fp32 logits alone: {tokens * vocab * 4 / 2**20:.0f})", flush=True)


def precision(tokens: int = 4096, width: int = 256, vocab: int = 32000) -> None:
    g = torch.Generator().manual_seed(0)
    h64, w64 = torch.randn(tokens, width, dtype=torch.float64, generator=g), torch.randn(vocab, width, dtype=torch.float64,
                                                                                       generator=g) * 0.15
    y = torch.randint(0, vocab, (tokens,), generator=g)

    def run(loss, dtype):
        h, w = (t.detach().clone().to(dtype).requires_grad_() for t in (h64, w64))
        out = loss(h, w)
        out.backward()
        return [t.detach().double() for t in (out, h.grad, w.grad)]

    ref = run(lambda h, w: full_loss(h @ w.T, y), torch.float64)
    options = torch.nn.LinearCrossEntropyOptions(acc_dtype=torch.float32)
    losses = {"full (upcast)": lambda h, w: full_loss(h @ w.T, y), "chunked (ours)": lambda h, w: chunked_loss(h, w, y),
              "torch's chunked op": lambda h, w: F.linear_cross_entropy(h, w, y, options=options)}
    print(f"bf16, {tokens} tokens, width {width}, vocabulary {vocab}: max relative error against float64")
    for name, f in losses.items():
        got = run(f, torch.bfloat16)
        err = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]
        print(f"{name:20s} loss {got[0].item():.6f} (float64 {ref[0].item():.6f}): loss {err[0]:.2e}, hidden states' "
              f"gradient {err[1]:.2e}, weight's gradient {err[2]:.2e}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    what, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    if what == "fake":
        v, d, n = args
        for name, f in (("full", lambda h, w, y: full_loss(h @ w.T, y)), ("chunked", chunked_loss)):
            print(f"{name}: {fake_head_bytes(f, v, d, n, torch.bfloat16) / 2**30:.2f} GiB (vocabulary {v}, width {d}, "
                  f"{n} tokens, bf16, fake tensors)")
    elif what == "precision":
        precision(*args)
    else:
        main(*args)
