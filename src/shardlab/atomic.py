"""Files a reader never sees half written: `write_json_atomic` (run_args.json, metrics.json, a
checkpoint's manifest, the hang doctor's records), and `remove_tree` (a checkpoint deleted). Standard library only, so the doctor's
reading side and the launchers use it without torch."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any


def write_json_atomic(path: str, data: Any, *, default: Any = None) -> None:
    """Write to a temporary file in the same directory, flush it to disk, then rename: readers
    never see half a file, even after a crash. `default` as in json.dump (None: non-JSON
    values are an error, as a checkpoint manifest wants)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=default)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_tree(path: str) -> None:
    """Rename first (atomic), so a crash mid-deletion leaves nothing that looks like a checkpoint."""
    doomed = f"{path}.deleting-{os.getpid()}"
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)
