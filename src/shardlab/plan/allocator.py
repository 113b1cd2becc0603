"""From the live bytes plan predicts to the bytes the CUDA caching allocator reserves
(`reserved_bytes`) and to what the device shows (`device_bytes`).

[Note: live, reserved, device]
- live (`peak_bytes`): the bytes of tensors alive at the step's peak, what the probes measure.
- reserved (`reserved_bytes`): `torch.cuda.max_memory_reserved()`, the segments the caching
  allocator holds from cudaMalloc: what torchtitan reports as "memory", and what an OOM message
  calls "reserved in total by PyTorch". It exceeds live by
  (a) rounding and fragmentation of what churns: a request is rounded up to 512 bytes and
      served from a 2 MiB segment (< 1 MiB), a 20 MiB one (1-10 MiB) or its size rounded up to
      2 MiB (larger); a freed block stays cached, split blocks cannot serve a larger request, and
      blocks freed on one stream (FSDP2 gathers on its own) serve that stream first. Only the
      transient part of the peak churns (activations, gathered parameters, unsharded gradients,
      communication buffers): parameters, gradients and optimizer state are allocated once, in
      the same sizes every step. `FRAGMENTATION` of the transient part is assumed: it is NOT
      measured here (this machine has no GPU); `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
      brings it near zero.
  (b) cuBLAS's workspace, which torch allocates through the caching allocator, one per handle
      and stream: 4096 KiB x 8 = 32 MiB on Hopper (torch's default CUBLAS_WORKSPACE_CONFIG there),
      4096 KiB x 2 + 16 KiB x 8 before; one compute stream counted.
- device (`device_bytes`): what nvidia-smi shows for the process: reserved plus what is outside
  the allocator: the CUDA context and kernels (~0.5 GiB with lazy module loading, the default
  since CUDA 11.7) and NCCL's own buffers (per communicator; ~0.5 GiB assumed for a node's
  communicator, not measured here). Those two are the "not usable" part of a GPU in
  catalogue.CUDA_CONTEXT_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The transient parts of a peak: what is allocated and freed within a step.
TRANSIENT_PARTS = ("gathered_params", "unsharded_grads", "activations", "comm", "other")
#: Reserved beyond live, as a fraction of the transient bytes at the peak (assumed; see the Note).
FRAGMENTATION = 0.10
CONTEXT_BYTES = 512 * 2**20
NCCL_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Reserved:
    reserved_bytes: int
    device_bytes: int
    parts: dict[str, int]


def cublas_workspace_bytes(gpu_name: str) -> int:
    """torch's default cuBLAS workspace for one stream: Hopper 32 MiB, older 8 MiB + 128 KiB."""
    return 32 * 2**20 if gpu_name in ("H100", "H200") else 4096 * 1024 * 2 + 16 * 1024 * 8


def reserved(parts: dict[str, int], gpu_name: str, world: int) -> Reserved:
    """The allocator's reserved peak and the device's total for a predicted peak `parts`."""
    transient = sum(parts.get(p, 0) for p in TRANSIENT_PARTS)
    frag = int(FRAGMENTATION * transient)
    cublas = cublas_workspace_bytes(gpu_name)
    live = sum(parts.values())
    res = live + frag + cublas
    outside = CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0)
    return Reserved(res, res + outside, {"live": live, "fragmentation": frag, "cublas_workspace": cublas,
                                         "cuda_context": CONTEXT_BYTES, "nccl": outside - CONTEXT_BYTES})
