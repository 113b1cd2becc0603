"""What plan knows of the hardware: GPUs (memory, bf16, peak FLOP/s) and the links between
ranks (alpha-beta constants per collective kind), each with its source."""

from __future__ import annotations

from dataclasses import dataclass


# -- GPUs -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as sold (GB = 1e9 bytes where the vendor says GB)
    bf16: bool                 # native bfloat16 (Ampere and newer)
    peak_flops: float          # dense tensor-core FLOP/s at the training dtype (bf16, or fp16 on T4), no sparsity
    source: str


# Vendor data sheets (dense, no structured sparsity). T4: 65 TFLOP/s fp16 tensor cores, no bf16
# (Turing). L4: 121 TFLOP/s bf16 dense (242 with sparsity). A100: 312 TFLOP/s bf16. H100 SXM:
# 989 TFLOP/s bf16 dense. H200: same compute as H100 SXM, 141 GB HBM3e.
GPUS: dict[str, GPU] = {
    "T4": GPU("T4", 16 * 10**9, False, 65e12, "NVIDIA T4 data sheet: 16 GB GDDR6, 65 TFLOPS fp16 tensor"),
    "L4": GPU("L4", 24 * 10**9, True, 121e12, "NVIDIA L4 data sheet: 24 GB, 242 TFLOPS bf16 with sparsity"),
    "A100-40": GPU("A100-40", 40 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 40 GB HBM2, 312 TFLOPS bf16"),
    "A100-80": GPU("A100-80", 80 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 80 GB HBM2e, 312 TFLOPS bf16"),
    "H100": GPU("H100", 80 * 10**9, True, 989e12, "NVIDIA H100 SXM data sheet: 80 GB HBM3, 989 TFLOPS bf16 dense"),
    "H200": GPU("H200", 141 * 10**9, True, 989e12, "NVIDIA H200 data sheet: 141 GB HBM3e, H100 compute"),
}
#: Memory no tensor can use: the CUDA context and libraries (cuBLAS/NCCL workspaces), ~0.5-1 GiB.
CUDA_CONTEXT_BYTES = 1 * 2**30
#: Of the rest, the fraction the caching allocator can hand out before fragmentation bites.
ALLOCATOR_USABLE_FRACTION = 0.90
#: Model FLOPs utilisation assumed for GPU step-time predictions (typical for FSDP training of
#: decoders at this scale: 30-50 % on A100/H100; stated, not measured here).
MFU = 0.40


def usable_bytes(gpu: GPU) -> int:
    return int((gpu.memory_bytes - CUDA_CONTEXT_BYTES) * ALLOCATOR_USABLE_FRACTION)


# -- interconnects (alpha-beta) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float             # latency per collective step (s)
    bandwidth: float           # bytes/s one rank can send (bus bandwidth)
    source: str
    #: (kind, alpha_s, bandwidth) that replace the pair above for one collective kind: gloo's
    #: kinds are implemented very differently (its reduce_scatter copies and all-reduces), so one
    #: pair cannot describe them all (docs/memory.md, "Step time").
    per_kind: tuple[tuple[str, float, float], ...] = ()

    def constants(self, kind: str) -> tuple[float, float]:
        for k, a, b in self.per_kind:
            if k == kind:
                return a, b
        return self.alpha_s, self.bandwidth


#: Per-link constants: alpha (latency per ring step) and bus bandwidth per rank. "loopback" is
#: fitted on this machine (docs/memory.md, `python -m shardlab.plan fit-loopback`); the others
#: are nominal figures from vendor specifications with a stated efficiency.
INTERCONNECTS: dict[str, Link] = {
    # 2026-11-23, `python -m shardlab.plan fit-loopback` (median of 15 calls per kind and size, 4 KiB-16 MiB),
    # timing the engines' own collectives (on CPU, all-gather and reduce-scatter in place: collectives.py):
    # per-kind mean |error| 19 % at the 2 fitted workers, 51 % at 4 (oversubscribed: 4 workers on 2 cores);
    # the constants moved by up to 3x between runs on this shared VM (docs/memory.md, "Step time").
    "loopback": Link("loopback", 211.7e-6, 1.548e9, "fitted here: gloo on 127.0.0.1, 2 workers, 2 CPU cores",
                     (("all_gather", 583.8e-6, 0.711e9), ("all_reduce", 394.7e-6, 0.914e9),
                      ("broadcast", 130.7e-6, 2.401e9), ("reduce", 483.2e-6, 1.041e9),
                      ("reduce_scatter", 799.5e-6, 0.414e9))),
    "pcie": Link("pcie", 10e-6, 0.8 * 16e9, "PCIe 4.0 x16: 32 GB/s per direction nominal; ~16 GB/s ring bus, 80 %"),
    "nvlink": Link("nvlink", 5e-6, 0.8 * 300e9, "NVLink 4 (H100): 450 GB/s per direction; ~300 GB/s NCCL bus, 80 %"),
    "infiniband-400": Link("infiniband-400", 5e-6, 0.8 * 50e9, "InfiniBand NDR 400 Gb/s = 50 GB/s per port, 80 %"),
    "ethernet-100": Link("ethernet-100", 30e-6, 0.7 * 12.5e9, "100 GbE = 12.5 GB/s, 70 % with TCP/NCCL sockets"),
}

