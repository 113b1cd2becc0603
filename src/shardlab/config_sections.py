"""The config's sections as typed dataclasses: every section but `model:`, whose keys each
model declares in its own file (config.py joins them into `ModelConfig`). Standard library only,
so the CLI checks a config's keys and values before it imports torch (config_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelName:
    """The keys of the `model:` section that every model has; each model adds its own."""

    name: str = "gpt"                      # a key of shardlab.models.MODELS
    sync_batchnorm: bool = False           # BatchNorm statistics over all ranks (distributed engines; docs/verify.md)


@dataclass
class DataConfig:
    source: str = "builtin"                # builtin | text | tokens | sft | cifar10 | synthetic
    path: Optional[str] = None             # tokens: a DATA_DIR from `shardlab prepare`; text: file, directory or
                                           # glob; sft: a JSON/JSONL file (null: the
                                           # embedded instruction set); cifar10: folder with cifar-10-batches-py
    mix: Optional[dict[str, float]] = None  # tokens: {DATA_DIR: weight, ...}, a weighted mixture of prepared
                                           # corpora instead of data.path (docs/data.md, "Mixtures")
    tokenizer: Optional[str] = None        # text: a local directory with tokenizer.json (null = bytes)
    tokenizer_path: Optional[str] = None   # sft: a local directory with tokenizer.json (null: model.hf_path's,
                                           # else a BPE trained at run time)
    packing: bool = False                  # sft: several examples per row (attention and loss never cross)
    seq_len: int = 128                     # text, sft: tokens per sample
    val_fraction: float = 0.05             # prepare's --val-fraction default too (tokens: fixed at prepare)
    val_from_train: bool = False           # tokens: a corpus without a val split holds out the last
                                           # val_fraction of its train windows for validation
    synthetic_samples: int = 4096
    shuffle: bool = True
    num_workers: Optional[int] = None      # DataLoader worker processes per rank (null: 2 on CUDA, 0 on CPU)


@dataclass
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1              # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 2
    optimizer: str = "adamw"               # adamw | sgd
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.0                  # sgd
    grad_clip: float = 1.0                 # 0 = off
    precision: str = "fp32"                # fp32 | bf16 | fp16 (autocast; fp16 adds dynamic loss scaling)
    loss_scale: float = 65536.0            # fp16: initial loss scale (halved on overflow)
    loss_scale_growth_interval: int = 2000  # fp16: good steps in a row before the scale doubles
    loss: str = "auto"                     # auto | chunked | full: the LM loss without whole logits (docs/training.md)
    activation_checkpointing: str = "none"  # none | full | selective (docs/training.md); true/false: old spellings
    ac_every: int = 1                      # checkpoint blocks 0, K, 2K, ... (1: every block)
    compile: bool = False                  # torch.compile each block (inductor; hooks stay outside)
    compile_mode: Optional[str] = None     # torch.compile mode: null (default) | reduce-overhead | max-autotune | ...
    eval_every: int = 0                    # 0 = only at the end
    eval_batches: int = 4
    log_every: int = 1
    memory_tracking: str = "last"          # live tensor bytes by part/phase (docs/memory.md): last | all | none
    profile: bool = False                  # torch.profiler Chrome trace of a few steps -> <run dir>/profile/
    profile_steps: int = 2                 # steps traced, after the first step of the run


@dataclass
class ParallelConfig:
    strategy: str = "fsdp"                 # a key of shardlab.engines.STRATEGIES
    # The keys below reach the engines that take them (their `options`; engine_options):
    reshard_after_forward: bool = True     # free gathered parameters after each unit's forward
    mixed_precision: str = "fp32"          # fp32 | bf16 | fp16: engine compute/communication dtype (fp64: verify's)
    reduce_dtype: Optional[str] = None     # gradients reduced in: null = as mixed_precision | fp32 | bf16 | fp16
    bucket_size_mb: float = 25.0           # gradient buckets of the all-reducing engines
    prefetch: bool = True                  # gather the next unit while this one computes
    shard_size: Optional[int] = None       # hybrid sharding over S ranks (null = ranks per node)
    offload: str = "none"                  # none | cpu: keep shards, grads and optimizer state on the host
    accumulate: str = "local"              # local | sharded: micro batches' gradients summed whole, or in the shard
    backend: str = "auto"                  # auto (nccl on CUDA, else gloo) | gloo | nccl
    timeout_s: float = 300.0               # every collective; a dead rank fails the others within it
    wrap_classes: Optional[list[str]] = None  # wrap units by class name (null: the model's default units)


@dataclass
class CheckpointConfig:
    every_steps: int = 0                   # 0 = off
    every_seconds: Optional[float] = None  # also save when this many seconds passed since the last save
    final: bool = True                     # save the last step's state when training ends (export, eval)
    keep_last: int = 2
    dir: Optional[str] = None              # null = <run dir>/checkpoints
    resume: str = "auto"                   # auto | none | a checkpoint path
    async_save: bool = False               # YAML key: checkpoint.async


@dataclass
class PreemptionConfig:
    """What a SIGTERM/SIGUSR1 does and how long the job must be given for it (docs/preemption.md)."""

    enabled: bool = True                   # save a checkpoint and exit 75 on SIGTERM/SIGUSR1
    grace_s: Optional[float] = None        # signal-to-exit seconds; null = ceil(2 x save + margin_s)
    save_s: Optional[float] = None         # one save; null = measured (newest checkpoint) or estimated
    write_mb_s: float = 100.0              # storage write speed the estimate assumes
    margin_s: float = 30.0                 # the step in flight, process exit, filesystem latency


@dataclass
class DoctorConfig:
    """The hang doctor (docs/debugging.md): each rank's heartbeat and collective record."""

    enabled: bool = True                   # <run dir>/debug: flight files, stack dumps, exit records
    record_size: int = 4096                # collectives kept per rank (a ring: the last ones)


@dataclass
class OutputConfig:
    dir: str = "runs"
    run_name: Optional[str] = None         # null = <model>-<strategy>-<timestamp>
    tensorboard: bool = True               # kept for older configs: with trackers unset, [tensorboard] or none
    trackers: Optional[list[str]] = None   # tensorboard | wandb | mlflow (observe/trackers.py); null: see above
    progress: bool = True


@dataclass
class ExportConfig:
    format: str = "none"                   # none | hf: at the end of training, write a Hugging Face directory
    dir: Optional[str] = None              # null = <run dir>/hf
    lora: str = "merged"                   # merged (adapters folded into the weights) | adapter (peft adapter alone)


# The sections after `model:`, in the order a config and `--print-config` list them.
SECTIONS: dict[str, type] = {"data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig,
                             "checkpoint": CheckpointConfig, "preemption": PreemptionConfig,
                             "doctor": DoctorConfig, "output": OutputConfig, "export": ExportConfig}
