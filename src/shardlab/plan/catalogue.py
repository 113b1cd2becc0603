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
    #: the link between the GPUs of one node (a key of INTERCONNECTS), and between nodes by default
    intra_node: str = "pcie-gen4"
    inter_node: str = "infiniband-400"


# Vendor data sheets (dense, no structured sparsity), as read from NVIDIA's product pages; the
# figures are the ones widely quoted from them, not re-derived here. T4: 65 TFLOP/s fp16 tensor
# cores, no bf16 (Turing), PCIe Gen3 x16, no NVLink. L4: 121 TFLOP/s bf16 dense (242 with
# sparsity), PCIe Gen4 x16, no NVLink. A100 SXM: 312 TFLOP/s bf16, NVLink 3 (600 GB/s per GPU,
# both directions). H100 SXM: 989 TFLOP/s bf16 dense, NVLink 4 (900 GB/s per GPU, both
# directions). H200: H100 SXM compute, 141 GB HBM3e, NVLink 4. (PCIe cards of A100/H100 exist with
# other figures: --interconnect pcie-gen4 / pcie-gen5 describes them.)
GPUS: dict[str, GPU] = {
    "T4": GPU("T4", 16 * 10**9, False, 65e12, "NVIDIA T4 data sheet: 16 GB GDDR6, 65 TFLOPS fp16 tensor, PCIe Gen3",
              intra_node="pcie-gen3", inter_node="gke-n1-t4"),
    "L4": GPU("L4", 24 * 10**9, True, 121e12, "NVIDIA L4 data sheet: 24 GB, 242 TFLOPS bf16 with sparsity, PCIe Gen4",
              intra_node="pcie-gen4", inter_node="gke-g2-l4"),
    "A100-40": GPU("A100-40", 40 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 40 GB HBM2, 312 TFLOPS bf16, SXM",
                   intra_node="nvlink3"),
    "A100-80": GPU("A100-80", 80 * 10**9, True, 312e12, "NVIDIA A100 data sheet: 80 GB HBM2e, 312 TFLOPS bf16, SXM",
                   intra_node="nvlink3"),
    "H100": GPU("H100", 80 * 10**9, True, 989e12, "NVIDIA H100 SXM data sheet: 80 GB HBM3, 989 TFLOPS bf16 dense",
                intra_node="nvlink4"),
    "H200": GPU("H200", 141 * 10**9, True, 989e12, "NVIDIA H200 data sheet: 141 GB HBM3e, H100 compute",
                intra_node="nvlink4"),
}
#: Memory no tensor can use: the CUDA context and libraries (cuBLAS/NCCL workspaces), ~0.5-1 GiB.
CUDA_CONTEXT_BYTES = 1 * 2**30
#: Of the rest, the fraction the caching allocator can hand out before fragmentation bites.
ALLOCATOR_USABLE_FRACTION = 0.90
#: Model FLOPs utilisation assumed for GPU step-time predictions (typical for FSDP training of
#: decoders at this scale: 30-50 % on A100/H100; stated, not measured here; docs/memory.md
#: compares it with torchtitan's published Llama 3.1 8B runs, 33-39 % on H100).
MFU = 0.40


def usable_bytes(gpu: GPU) -> int:
    return int((gpu.memory_bytes - CUDA_CONTEXT_BYTES) * ALLOCATOR_USABLE_FRACTION)


def default_link(gpu: GPU, nodes: int) -> str:
    """The link plan assumes without --interconnect: the GPU's own within a node, its usual
    fabric across nodes (T4: GKE's N1 network; the others: InfiniBand NDR)."""
    return gpu.intra_node if nodes == 1 else gpu.inter_node


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
    # Per GPU within one node (each GPU's own link; GPUS[...].intra_node):
    # T4: PCIe Gen3 x16, 15.75 GB/s per direction nominal; GPU to GPU through the host bridge, no
    # NVLink; ~12 GB/s usable (/work/shared/FIELD-NOTES.md); 10 us per step assumed.
    "pcie-gen3": Link("pcie-gen3", 10e-6, 12e9, "PCIe Gen3 x16 (T4): 15.75 GB/s per direction; ~12 GB/s usable"),
    # L4 (and PCIe cards of A100/H100): PCIe Gen4 x16, 31.5 GB/s per direction nominal, 80 %.
    "pcie-gen4": Link("pcie-gen4", 10e-6, 0.8 * 31.5e9, "PCIe Gen4 x16: 31.5 GB/s per direction, 80 %"),
    "pcie-gen5": Link("pcie-gen5", 10e-6, 0.8 * 63e9, "PCIe Gen5 x16: 63 GB/s per direction, 80 %"),
    # NVLink 3 (A100 SXM): 600 GB/s per GPU both directions = 300 per direction; 80 % of it.
    "nvlink3": Link("nvlink3", 5e-6, 0.8 * 300e9, "NVLink 3 (A100 SXM): 300 GB/s per direction, 80 %"),
    # NVLink 4 (H100/H200 SXM): 900 GB/s both directions = 450 per direction; 80 % of it.
    "nvlink4": Link("nvlink4", 5e-6, 0.8 * 450e9, "NVLink 4 (H100/H200 SXM): 450 GB/s per direction, 80 %"),
    # Between nodes, per cloud. Google Cloud, "Networking and GPU machines"
    # (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth, read 2026-11-23): N1 VMs with T4
    # get up to 100 Gbps "based on the combination of GPU and vCPU count" (the per-shape table
    # was not read: a small N1 shape gets less), TCP only (no GPUDirect RDMA on N1), gVNIC needed
    # above 50 Gbps; G2 (L4): up to 100 Gbps. 70 % of 100 Gbps assumed, with socket latency.
    "gke-n1-t4": Link("gke-n1-t4", 30e-6, 0.7 * 12.5e9, "GKE N1 + T4: up to 100 Gbps TCP (Google Cloud docs), 70 %"),
    "gke-g2-l4": Link("gke-g2-l4", 30e-6, 0.7 * 12.5e9, "GKE G2 + L4: up to 100 Gbps TCP (Google Cloud docs), 70 %"),
    # Nebius H100 nodes: 8 x 400 Gb/s NDR InfiniBand per host (3.2 Tbit/s), one port per GPU, as
    # Nebius describes its H100 clusters; not verified against a Nebius document here (no
    # page of theirs with the figure was found): the same constants as infiniband-400.
    "nebius-ib-400": Link("nebius-ib-400", 5e-6, 0.8 * 50e9, "Nebius H100: NDR InfiniBand 400 Gb/s per GPU, 80 %"),
}

