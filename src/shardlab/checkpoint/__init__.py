"""Sharded checkpoints: every rank writes what it holds, any engine at any world size reads them.

On disk (see docs/checkpointing.md):

    <checkpoint dir>/step_00000040/        a complete checkpoint (renamed from .tmp when done)
        .metadata                          torch.distributed.checkpoint (DCP) index
        __0_0.distcp, __1_0.distcp, ...    one data file per rank that wrote something
        shardlab.json                      manifest, written last: step, shapes, schedule, files
                                           with their sizes and SHA-256
    <checkpoint dir>/step_00000050.tmp/    a save in progress, or torn by a crash: ignored

One format for every engine. Each original parameter is stored as its *flattened* 1-D full
tensor under `model/<name>` (its shape in the manifest), and each rank contributes the
contiguous ranges it holds, as described by `Engine.shard_layout()` (or, for FSDP2's
DTensor parameters, by their Shard(0) placement). Optimizer state tensors shaped like their
parameter go under `optim/<name>/<key>` the same way; scalar state (Adam's `step`) is a
0-dim tensor per parameter. Replicated engines write each tensor once: DCP keeps one of the
identical chunks. Loading plans reads for the ranges the *loading* engine holds, so any
engine at any world size reads any checkpoint (DCP's resharding, on 1-D chunks).

Besides model and optimizer: persistent buffers, the LR schedule, the train state (step =
data position, per-step losses) and every rank's RNG states (torch CPU, CUDA, python,
numpy) under `rng/<rank>/...`. Tensors go through DCP, the rest is JSON.

Loading never runs code from the checkpoint: DCP's `.metadata` is a pickle, so it is read by
an unpickler that admits only the classes DCP's metadata is made of (`SafeReader`), the
data files are read by `torch.load(weights_only=True)`, and every file's SHA-256 is checked
against the manifest before anything is read (see "Security and integrity" in the docs).

The package, one concern a module:
    format.py      names on disk, the manifest, when a checkpoint is complete, listing, CheckpointError
    planners.py    what a rank holds (Engine.shard_layout) and the DCP save/load planners
    rng.py         every rank's RNG states as tensors
    integrity.py   SHA-256 of every file; DCP metadata read without running code
    reader.py      the offline reader for export/generate/eval (one process, no group)
    manager.py     CheckpointManager: when to save, where to resume, save and load
    space.py       a save that did not fit (ENOSPC, EDQUOT): agreed by all ranks, said with what is intact
"""

import warnings

from shardlab.checkpoint.format import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    read_manifest,
    step_dir_name,
)
from shardlab.checkpoint.integrity import HASH_KEY, check_file_hashes, file_sha256, read_dcp_metadata
from shardlab.checkpoint.manager import CheckpointManager
from shardlab.checkpoint.planners import checkpoint_layout
from shardlab.checkpoint.reader import (
    build_model_from_record,
    list_checkpoints,
    read_model_state,
    read_tensors,
    resolve_checkpoint,
    verify_checkpoint,
)
from shardlab.checkpoint.rng import capture_rng, restore_rng

# A single process saves and loads with no_dist=True on purpose (the manager and reader); DCP
# warns about it on every call, which every single-process run's final save would print.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__all__ = ["CheckpointError", "CheckpointManager", "DCP_METADATA", "FORMAT", "FORMAT_VERSION", "HASH_KEY",
           "MANIFEST", "build_model_from_record", "capture_rng", "check_file_hashes", "checkpoint_layout",
           "file_sha256", "list_checkpoints", "read_dcp_metadata", "read_manifest", "read_model_state",
           "read_tensors", "resolve_checkpoint", "restore_rng", "step_dir_name", "verify_checkpoint"]
