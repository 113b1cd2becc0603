"""The offline reader (`shardlab export`, `generate`, `eval`): find, verify and read a
checkpoint in one process, with no process group, and rebuild its model."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from shardlab.checkpoint.format import (
    DCP_METADATA,
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    check_complete,
    list_checkpoints,
    what_to_do,
)
from shardlab.checkpoint.integrity import SafeReader, check_file_hashes, dcp_load
from shardlab.checkpoint.planners import TensorOnlyLoadPlanner
from shardlab.models import rebuild_model

__all__ = ["verify_checkpoint", "list_checkpoints", "resolve_checkpoint", "read_tensors", "read_model_state",
           "build_model_from_record"]

log = logging.getLogger("shardlab.checkpoint")


def verify_checkpoint(path: str, *, hashes: bool = False) -> dict[str, Any]:
    """Check that `path` is a complete checkpoint (every listed file there at its listed size;
    cheap: stats only) and, with hashes=True, intact (check_file_hashes: reads every byte);
    return its manifest."""
    manifest = check_complete(path)
    if hashes:
        check_file_hashes(path, manifest)
    return manifest


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a checkpoint, a checkpoints directory or a run directory."""
    if os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, DCP_METADATA)) \
            or STEP_DIR.match(os.path.basename(path.rstrip("/"))) or path.rstrip("/").endswith(".tmp"):
        verify_checkpoint(path)
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = list_checkpoints(root)
        if found:
            return found[-1][1]
    raise CheckpointError(f"no complete checkpoint under {path}; a run keeps its last step unless "
                          "checkpoint.final=false (checkpoint.every_steps=N keeps more); a run directory, its "
                          "checkpoints/ directory or a step_* directory is accepted")


def read_tensors(path: str, prefix: str = "", *, manifest: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor whose key starts with `prefix` as a full tensor, in this process alone
    (no process group): DCP reassembles each from the chunks all ranks wrote. The checkpoint
    is verified first (sizes and SHA-256 of every file) unless its already verified manifest
    is given."""
    if manifest is None:
        manifest = verify_checkpoint(path, hashes=True)
    reader = SafeReader(path, manifest)
    md = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix)}
    try:
        with warnings.catch_warnings():  # DCP warns that no process group exists: that is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state, reader, TensorOnlyLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"reading checkpoint {path} failed ({type(e).__name__}: {e}); it is damaged: "
                              f"{what_to_do(path)}") from e
    return state


def read_model_state(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The consolidated model state_dict (original names, tied names included, original
    shapes) of a checkpoint, read in one process; and its manifest."""
    manifest = verify_checkpoint(path, hashes=True)
    flat = read_tensors(path, "model/", manifest=manifest)
    try:
        shapes = {**manifest["params"], **manifest["buffers"]}
        by_name = {k[len("model/"):]: v.view(shapes[k[len("model/"):]]) for k, v in flat.items()}
        keys = manifest.get("state_dict_keys") or {k: k for k in shapes}
        out = {}
        for key, canonical in keys.items():
            t = by_name[canonical]
            out[key] = t if key == canonical else t.clone()  # safetensors refuses shared storage
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} and the stored tensors disagree ({type(e).__name__}: "
                              f"{e}); the checkpoint is damaged: {what_to_do(path)}") from None
    return out, manifest



# ============================================================================ model description
def build_model_from_record(record: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """The checkpointed architecture (shardlab.models.rebuild_model), without the training data."""
    if "gpt_config" in record:  # manifests written before the model registry
        record = {**record, "kwargs": record["gpt_config"]}
    return rebuild_model(record, device)


def _state_dict_keys(record: dict[str, Any] | None) -> dict[str, str] | None:
    """state_dict key -> canonical parameter name (tied parameters share one), from a meta rebuild."""
    if record is None:
        return None
    meta = build_model_from_record(record, "meta")
    canonical = {id(p): n for n, p in meta.named_parameters()}
    return {k: canonical.get(id(v), k) for k, v in meta.state_dict(keep_vars=True).items()}
