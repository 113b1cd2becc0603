"""What plan knows of the hardware: GPUs (memory, bf16, peak FLOP/s by dtype, memory bandwidth) and the
links between ranks (alpha-beta constants per collective kind), each with its source."""

from __future__ import annotations

from dataclasses import dataclass


# -- GPUs -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as sold (GB = 1e9 bytes where the vendor says GB)
    bf16: bool                 # native bfloat16 (Ampere and newer)
    #: dense peak FLOP/s by the dtype matmuls run in (no sparsity): "fp32" (CUDA cores), "tf32", "fp16"
    #: and "bf16" (tensor cores); a dtype the GPU lacks is absent
    peaks: dict[str, float]
    memory_bandwidth: float    # bytes/s, the data sheet's (HBM or GDDR)
    source: str
    #: the link between the GPUs of one node (a key of INTERCONNECTS), and between nodes by default
    intra_node: str = "pcie-gen4"
    inter_node: str = "infiniband-400"
    #: (FLOP/s, source) the fastest bf16/fp16 matmul measured on this GPU reaches, where someone measured
    #: it (MAMF: plan/clock.py); None: the data sheet's peak is the only ceiling known
    achievable_half: tuple[float, str] | None = None

    @property
    def peak_flops(self) -> float:
        """The dense tensor-core peak at the training dtype (bf16, or fp16 on T4)."""
        return self.peaks.get("bf16" if self.bf16 else "fp16") or self.peaks["fp32"]

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of matmuls in `dtype` ("fp32", "tf32", "bf16", "fp16"); fp32 without tf32:
        the CUDA cores' figure, as PyTorch leaves fp32 matmuls unless allow_tf32 is set (shardlab never sets it)."""
        if dtype not in self.peaks:
            raise KeyError(f"{self.name} has no {dtype} peak (it has {', '.join(self.peaks)})")
        return self.peaks[dtype]


# Where each GPU figure comes from (checked 2026-11-23, dtypes and bandwidth 2026-11-28). The provider's
# table: Google Cloud, "GPU machine types" (cloud.google.com/compute/docs/gpus), read in its S3NS mirror
# (documentation.s3ns.fr/compute/docs/gpus, "Last updated 2026-08-26"): the "General comparison
# chart" gives memory and interconnect, "Tensor Core and standard CUDA core performance" gives
# FLOP/s, which "assume dense matrix multiplication" (structured sparsity doubles them), and its
# footnote names H200, H100, A100 and L4 as the ones that "also support the bfloat16 data type"
# (T4 is not named: Turing has no bf16). Peaks by dtype (fp32, tf32, fp16/bf16, dense) and memory
# bandwidth: NVIDIA's data sheets by name (T4 "NVIDIA T4 Tensor Core GPU" data sheet: FP32 8.1
# TFLOPS, mixed FP16/FP32 65, GDDR6 320 GB/s; L4 data sheet: FP32 30.3, TF32 120 and BF16/FP16 242
# with sparsity (60 / 121 dense), 300 GB/s; A100 data sheet (nvidia.com/en-us/data-center/a100):
# FP32 19.5, TF32 156, BF16/FP16 312, 40GB 1,555 GB/s, 80GB SXM 2,039 GB/s; H100 SXM (nvidia.com/en-us/
# data-center/h100): FP32 67, TF32 989 and BF16 1,979 with sparsity (494.5 / 989 dense), 3.35 TB/s;
# H200 SXM (nvidia.com/en-us/data-center/h200): compute as H100, 4.8 TB/s), as restated with the
# dense figures in Stas Bekman's "Machine Learning Engineering", compute/accelerator/README.md
# (github.com/stas00/ml-engineering, "TFLOPS comparison table" and the memory table) for A100, H100 and
# H200, and by third-party spec pages for T4 (sysrqmts.com: FP32 8.141, FP16 65.13 TFLOPS, 320 GB/s).
# The data sheets themselves were not in the stored corpora. PCIe cards of A100/H100 have other
# figures: --interconnect pcie-gen4 / pcie-gen5 describes their link.
_GCP_GPUS = "Google Cloud, 'GPU machine types' (cloud.google.com/compute/docs/gpus)"
#: The Maximum Achievable Matmul FLOPS (bf16, the best of a sweep of shapes, torch 2.6-2.7), measured by
#: Stas Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul
#: FLOPS comparison table" (github.com/stas00/ml-engineering): A100 SXM 271.2 of 312 (86.9 %), H100 SXM
#: 794.5 of 989 (80.3 %). Nobody's figure for T4, L4 or H200 was found: their ceiling is the data sheet's.
_MAMF = "Bekman, 'Machine Learning Engineering' (github.com/stas00/ml-engineering), MAMF table"
GPUS: dict[str, GPU] = {
    "T4": GPU("T4", 16 * 10**9, False, {"fp32": 8.1e12, "fp16": 65e12}, 320e9,
              f"{_GCP_GPUS}: N1 (T4) 16 GB GDDR6, interconnect N/A, Tensor Core mixed FP16/32 65 TFLOPS, "
              "not among the bfloat16 GPUs; PCIe Gen3 x16 card; NVIDIA T4 data sheet: FP32 8.1 TFLOPS, 320 GB/s",
              intra_node="pcie-gen3", inter_node="gke-n1-t4"),
    "L4": GPU("L4", 24 * 10**9, True, {"fp32": 30.3e12, "tf32": 60e12, "fp16": 121e12, "bf16": 121e12}, 300e9,
              f"{_GCP_GPUS}: G2 (L4) 24 GB GDDR6, interconnect N/A, mixed FP16/32 121 TFLOPS dense "
              "(242 with sparsity), bfloat16 supported; PCIe Gen4 x16 card; NVIDIA L4 data sheet: FP32 30.3, "
              "TF32 120 with sparsity, 300 GB/s",
              intra_node="pcie-gen4", inter_node="gke-g2-l4"),
    "A100-40": GPU("A100-40", 40 * 10**9, True, {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12},
                   1555e9,
                   f"{_GCP_GPUS}: A2 Standard (A100 40GB) 40 GB HBM2, NVLink Full Mesh @ 600 GBps, "
                   "mixed FP16/32 312 TFLOPS dense, bfloat16 supported; NVIDIA A100 data sheet: FP32 19.5, TF32 "
                   "156, 1,555 GB/s (40GB)",
                   intra_node="nvlink3", achievable_half=(271.2e12, f"{_MAMF}: A100 SXM")),
    "A100-80": GPU("A100-80", 80 * 10**9, True, {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12},
                   2039e9,
                   f"{_GCP_GPUS}: A2 Ultra (A100 80GB) 80 GB HBM2e, NVLink Full Mesh @ 600 GBps, "
                   "mixed FP16/32 312 TFLOPS dense, bfloat16 supported; NVIDIA A100 data sheet: FP32 19.5, TF32 "
                   "156, 2,039 GB/s (80GB SXM)",
                   intra_node="nvlink3", achievable_half=(271.2e12, f"{_MAMF}: A100 SXM")),
    "H100": GPU("H100", 80 * 10**9, True, {"fp32": 67e12, "tf32": 494.5e12, "fp16": 989e12, "bf16": 989e12},
                3.35e12,
                f"{_GCP_GPUS}: A3 (H100 SXM) 80 GB HBM3, NVLink Full Mesh @ 900 GBps, mixed FP16/32 "
                "989.5 TFLOPS dense (989 kept: 0.05 % apart), bfloat16 supported; NVIDIA H100 SXM data sheet: "
                "FP32 67, TF32 494.5 dense, 3.35 TB/s",
                intra_node="nvlink4", achievable_half=(794.5e12, f"{_MAMF}: H100 SXM")),
    # torchtitan's H100 benchmark card (Meta's Grand Teton): their benchmarks/llama3_h100_202412_torchtitan.md
    "H100-96": GPU("H100-96", 96 * 10**9, True, {"fp32": 67e12, "tf32": 494.5e12, "fp16": 989e12, "bf16": 989e12},
                   2.4e12,
                   "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton): H100 SXM with 96GB HBM2e "
                   "'with 2.4 TB/sec peak memory bandwidth', 500W power limit; its peak FLOP/s 'between SXM and NVL' "
                   "and not known: H100 SXM's kept (an upper bound)",
                   intra_node="nvlink4", achievable_half=(794.5e12, f"{_MAMF}: H100 SXM (700 W; an upper bound)")),
    "H200": GPU("H200", 141 * 10**9, True, {"fp32": 67e12, "tf32": 494.5e12, "fp16": 989e12, "bf16": 989e12},
                4.8e12,
                f"{_GCP_GPUS}: A3 Ultra (H200 SXM) 141 GB HBM3e, NVLink Full Mesh @ 900 GBps, mixed "
                "FP16/32 989.5 TFLOPS dense (as H100; 989 kept), bfloat16 supported; NVIDIA H200 data sheet: "
                "compute as H100 SXM, 4.8 TB/s",
                intra_node="nvlink4"),
}
#: Memory no tensor can use: the CUDA context and libraries (cuBLAS/NCCL workspaces), ~0.5-1 GiB.
CUDA_CONTEXT_BYTES = 1 * 2**30
#: Of the rest, the fraction the caching allocator can hand out before fragmentation bites.
ALLOCATOR_USABLE_FRACTION = 0.90


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
#: are a nominal figure from a standard or a provider's page times an efficiency. Every alpha and
#: every efficiency fraction (70-80 %) is an assumption, not read from any document or measured.
INTERCONNECTS: dict[str, Link] = {
    # 2026-11-23, `python -m shardlab.plan fit-loopback` (median of 15 calls per kind and size, 4 KiB-16 MiB),
    # timing the engines' own collectives (on CPU, all-gather and reduce-scatter in place: collectives.py):
    # per-kind mean |error| 19 % at the 2 fitted workers, 51 % at 4 (oversubscribed: 4 workers on 2 cores);
    # the constants moved by up to 3x between runs on this shared VM (docs/memory.md, "Step time").
    "loopback": Link("loopback", 211.7e-6, 1.548e9, "fitted here: gloo on 127.0.0.1, 2 workers, 2 CPU cores",
                     (("all_gather", 583.8e-6, 0.711e9), ("all_reduce", 394.7e-6, 0.914e9),
                      ("broadcast", 130.7e-6, 2.401e9), ("reduce", 483.2e-6, 1.041e9),
                      ("reduce_scatter", 799.5e-6, 0.414e9))),
    # Kept for existing commands; their bandwidths are assumptions, not a document's figure.
    "pcie": Link("pcie", 10e-6, 0.8 * 16e9,
                 "legacy: assumed ~16 GB/s ring bus over PCIe (Gen4 x16 is 31.5 GB/s per direction: see "
                 "pcie-gen4), 80 %, 10 us assumed"),
    "nvlink": Link("nvlink", 5e-6, 0.8 * 300e9,
                   "legacy: 300 GB/s per direction (= NVLink 3, A100's 600 GB/s both ways; H100's NVLink 4 "
                   "is 450: see nvlink4), 80 %, 5 us assumed"),
    "infiniband-400": Link("infiniband-400", 5e-6, 0.8 * 50e9,
                           "NVIDIA, 'MMA4Z00-NS 800Gb/s Twin-port OSFP' overview (docs.nvidia.com/networking/"
                           "display/800GMMA4Z00NS/Overview): 'line rate is 400Gb/s for ... NDR InfiniBand'; "
                           "400 Gb/s = 50 GB/s per port per direction, one port per GPU assumed; 80 %, 5 us "
                           "assumed"),
    "ethernet-100": Link("ethernet-100", 30e-6, 0.7 * 12.5e9,
                         "100 GbE = 12.5 GB/s per direction (IEEE 802.3 line rate; the standard itself not "
                         "read); 70 % with TCP/NCCL sockets and 30 us assumed"),
    # Per GPU within one node (each GPU's own link; GPUS[...].intra_node). PCIe figures are derived
    # from the PCIe line rates (Gen3 8, Gen4 16, Gen5 32 GT/s per lane, 128b/130b encoding, x16):
    # 15.75 / 31.5 / 63 GB/s per direction; PCI-SIG's specification was not in the stored corpora.
    "pcie-gen3": Link("pcie-gen3", 10e-6, 12e9,
                      "PCIe Gen3 x16 (T4; Google lists no GPU interconnect for N1 T4): 15.75 GB/s per "
                      "direction by the line rate; ~12 GB/s usable GPU to GPU through the host is the "
                      "team's assumption (/work/shared/FIELD-NOTES.md), 10 us assumed"),
    "pcie-gen4": Link("pcie-gen4", 10e-6, 0.8 * 31.5e9,
                      "PCIe Gen4 x16 (L4; PCIe cards of A100/H100): 31.5 GB/s per direction by the line "
                      "rate; 80 %, 10 us assumed"),
    "pcie-gen5": Link("pcie-gen5", 10e-6, 0.8 * 63e9,
                      "PCIe Gen5 x16: 63 GB/s per direction by the line rate; 80 %, 10 us assumed"),
    "nvlink3": Link("nvlink3", 5e-6, 0.8 * 300e9,
                    f"{_GCP_GPUS}: A100 'NVLink Full Mesh @ 600 GBps' (both directions) = 300 GB/s per "
                    "direction; 80 %, 5 us assumed"),
    "nvlink4": Link("nvlink4", 5e-6, 0.8 * 450e9,
                    f"{_GCP_GPUS}: H100/H200 'NVLink Full Mesh @ 900 GBps' (both directions) = 450 GB/s "
                    "per direction; 80 %, 5 us assumed"),
    # Between nodes, per cloud. A VM's figure is its egress limit, shared by all its GPUs; a ring
    # collective crosses each VM boundary once per ring, so it bounds the ring's bus bandwidth.
    # Google Cloud, "Networking and GPU machines" (cloud.google.com/compute/docs/gpus/
    # gpu-network-bandwidth; search excerpts, the page's per-shape N1 section was not reachable):
    # N1 with T4 "up to 100 Gbps, based on the combination of GPU and vCPU count", GPU-to-GPU
    # technology "N/A" for N1 and G2 (TCP, no GPUDirect), gVNIC recommended for 50 Gbps or more.
    # Google Cloud, "Network bandwidth" (cloud.google.com/compute/docs/network-bandwidth): an
    # n1-standard-8 is limited to 16 Gbps egress, so a small N1 T4 shape gets far less than 100.
    "gke-n1-t4": Link("gke-n1-t4", 30e-6, 0.7 * 12.5e9,
                      "Google Cloud, 'Networking and GPU machines' (cloud.google.com/compute/docs/gpus/"
                      "gpu-network-bandwidth): N1 + T4 'up to 100 Gbps, based on the combination of GPU "
                      "and vCPU count' (the best shape: 4 T4, many vCPUs, gVNIC; per-shape table not "
                      "read; an n1-standard-8 gets 16 Gbps per 'Network bandwidth'); TCP; 70 %, 30 us "
                      "assumed"),
    "gke-g2-l4": Link("gke-g2-l4", 30e-6, 0.7 * 12.5e9,
                      f"{_GCP_GPUS}, G2 table, maximum network bandwidth per VM: g2-standard-96 (8 L4) "
                      "100 Gbps, -48 (4 L4) 50, -24 (2 L4) 32, 1-L4 shapes 10-32; 100 Gbps used (the "
                      "8-L4 shape); TCP; 70 %, 30 us assumed"),
    # Nebius: no Nebius page with the figure was in the stored corpora (nebius.com, docs.nebius.com
    # searched). A third-party summary of nebius.com's pages (stored in a public repository) gives
    # HGX H100 "1x or 8x H100 GPU (80 GB SXM) ... 3.2 Tbit/s InfiniBand" and "NVIDIA Quantum-2
    # InfiniBand: up to 3.2 Tbit/s per host, 400 Gbit/s per GPU NIC": 8 x 400 Gb/s, NDR.
    "nebius-ib-400": Link("nebius-ib-400", 5e-6, 0.8 * 50e9,
                          "Nebius HGX H100: 3.2 Tbit/s InfiniBand per 8-GPU host = 400 Gbit/s NDR per GPU "
                          "(from a third-party summary of nebius.com; Nebius's own page not in the "
                          "corpora) = 50 GB/s per direction; 80 %, 5 us assumed"),
}

