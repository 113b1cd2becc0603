"""The loss head's own peak memory, forward and backward, full against chunked (docs/memory.md, "The
loss head"): torch.profiler's memory timeline counts every allocation the CPU allocator sees, the
chunk buffers inside torch's chunked operator included (which the live-memory tracker, a dispatch
mode, does not see). The full loss grows with tokens x vocabulary; the chunked one only with tokens x
width and vocabulary x width.

    python -m tests.chunked_loss_peak 32000 256      # vocabulary, width
    python -m tests.chunked_loss_peak 128256 4096 16384 --fake    # Llama 3.1 8B's head at 2 x 8192 tokens

With --fake the head runs under plan's fake tensors (real shapes, no data: plan/probe.py) at one
size, in bf16, measured by the live-memory tracker as plan's probes measure a step: the head's part
of a plan at any size, the inputs (hidden states, weight) left out.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
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
    torch.set_num_threads(1)
    losses = {"full": lambda h, w, y: full_loss(h @ w.T, y), "chunked": chunked_loss}
    print(f"vocabulary {vocab}, width {width}: peak MiB of the head's forward and backward")
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (2048, 8192, 32768):
            got = {k: peak_bytes(f, vocab, width, tokens, dtype) / 2**20 for k, f in losses.items()}
            print(f"{str(dtype).removeprefix('torch.'):9s} tokens {tokens:6d}: full {got['full']:8.1f}  chunked "
                  f"{got['chunked']:6.1f}  (fp32 logits alone: {tokens * vocab * 4 / 2**20:.0f})", flush=True)


if __name__ == "__main__":
    if "--fake" in sys.argv:
        v, d, n = (int(a) for a in sys.argv[1:4])
        for name, f in (("full", lambda h, w, y: full_loss(h @ w.T, y)), ("chunked", chunked_loss)):
            print(f"{name}: {fake_head_bytes(f, v, d, n, torch.bfloat16) / 2**30:.2f} GiB (vocabulary {v}, width {d}, "
                  f"{n} tokens, bf16, fake tensors)")
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
