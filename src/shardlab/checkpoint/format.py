"""The on-disk format: names, the manifest (`shardlab.json`), what makes a checkpoint complete,
the complete checkpoints under a directory, and the error every reader raises."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from shardlab.errors import CheckpointError

log = logging.getLogger("shardlab.checkpoint")

FORMAT = "shardlab-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "shardlab.json"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"



# ============================================================================ on-disk helpers
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: str) -> dict[str, Any]:
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (it is written last, so the save "
                              "did not finish); resume from an earlier checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e}); the checkpoint is "
                              "corrupted; resume from an earlier one") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardlab checkpoint ({MANIFEST} has format {manifest.get('format')!r})")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {manifest['version']}; this shardlab reads "
                              f"up to {FORMAT_VERSION}: upgrade shardlab")
    return manifest


# ============================================================================ completeness
def check_complete(path: str) -> dict[str, Any]:
    """Check that `path` is a complete checkpoint (every listed file there at its listed size;
    cheap: stats only) and return its manifest. The hashes are `integrity.check_file_hashes`'."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory)")
    if path.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"checkpoint {path} is incomplete: a save still in progress or torn by a crash "
                              "(its name ends in .tmp); resume from an earlier checkpoint")
    if not os.path.exists(os.path.join(path, DCP_METADATA)):
        raise CheckpointError(f"checkpoint {path} is incomplete: no {DCP_METADATA}; resume from an earlier one")
    manifest = read_manifest(path)
    for name, size in manifest.get("files", {}).items():
        fp = os.path.join(path, name)
        if not os.path.exists(fp):
            raise CheckpointError(f"checkpoint {path} is incomplete: file {name} is missing")
        actual = os.path.getsize(fp)
        if actual != size:
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} has {actual} bytes, the manifest "
                                  f"says {size}; resume from an earlier checkpoint")
    return manifest


def list_checkpoints(root: str, *, complete_only: bool = True) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints under `root`, oldest first; torn or corrupted ones skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        if complete_only:
            try:
                check_complete(path)
            except CheckpointError as e:
                log.warning("skipping %s", e)
                continue
            except FileNotFoundError:
                continue  # pruned by the run while this reader listed it (its retention: a newer one exists)
        found.append((int(m.group(1)), path))
    return sorted(found)


def what_to_do(path: str) -> str:
    """The way out when checkpoint `path` cannot be used: name the previous complete checkpoint."""
    path = os.path.abspath(path.rstrip("/"))
    m = STEP_DIR.match(os.path.basename(path))
    earlier = [p for s, p in list_checkpoints(os.path.dirname(path))
               if m and s < int(m.group(1)) and os.path.abspath(p) != path]
    if earlier:
        return (f"delete it (or move it out of {os.path.dirname(path)}) and resume from the previous complete "
                f"checkpoint, {earlier[-1]} (checkpoint.resume=auto then picks it), or restore the file from a copy")
    return "delete it and restore the checkpoint from a copy; no earlier complete checkpoint exists beside it"
