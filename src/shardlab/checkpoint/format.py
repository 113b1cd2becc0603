"""The on-disk format: names, the manifest (`shardlab.json`), and the error every reader raises."""

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
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


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
