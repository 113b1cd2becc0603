"""A checkpoint that did not fit: which save failed because its filesystem was full (ENOSPC) or the
quota reached (EDQUOT), what is intact, and how much space the next save needs.

In the workers, the manager writes with `RecordingWriter` and agrees on a save's outcome with
`agree_save`: when any rank met a full filesystem, rank 0 removes the partial `step_N.tmp/` (never
read as a checkpoint: docs/checkpointing.md, "Atomicity") and every rank raises the same
`DiskFullError`, whose lines the launcher prints (doctor/agent.py, `failure_lines`). When the disk is
so full that the workers could not even leave their records, the launcher says what it sees itself
(`full_filesystem_lines`).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from shardlab.atomic import DISK_FULL_ERRNOS, disk_full_errno, remove_tree
from shardlab.checkpoint.format import list_checkpoints, read_manifest
from shardlab.errors import CheckpointError, DiskFullError

#: the launcher reads a filesystem with less free than this as full
FULL_BELOW_BYTES = 1 << 20


class RecordingWriter(FileSystemWriter):
    """DCP's file writer, keeping the full-filesystem errno this rank met. DCP hands a rank's
    failure to the others pickled, which drops the chain that holds it (torch.save reports ENOSPC
    as "unexpected pos", raised while handling the OSError)."""

    errno: int | None = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except BaseException as e:
            self.errno = disk_full_errno(e)
            raise

    def finish(self, metadata: Any, results: Any) -> None:
        try:
            super().finish(metadata, results)
        except BaseException as e:
            self.errno = disk_full_errno(e)
            raise


def fresh_directory(manager: Any, step: int, tmp: str) -> None:
    """The start of a save (every rank calls): rank 0 creates a fresh `step_N.tmp/` (removing one
    torn by an earlier crash at this same step) and every rank agrees, a full disk included."""
    error = manager.commit_full = None
    if manager.rt.rank == 0:
        try:
            os.makedirs(manager.root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as e:
            error, manager.commit_full = f"cannot create checkpoint directory {tmp}: {e}", disk_full_errno(e)
    agree_save(manager, step, tmp, error, manager.commit_full)


def agree_save(manager: Any, step: int, tmp: str, error: str | None, full: int | None) -> None:
    """The manager's `_agree` for a save (every rank calls, together): `error` this rank's problem,
    `full` the errno of a full filesystem it met. A full filesystem anywhere: rank 0 removes the
    partial checkpoint and every rank raises one DiskFullError; else any error, on every rank."""
    gathered = manager._all_gather((error, full))
    full = next((n for _, n in gathered if n in DISK_FULL_ERRNOS), None)
    if full is not None:
        lines = disk_full_lines(manager.root, step, tmp, full, manager.keep_last) if manager.rt.rank == 0 else None
        raise DiskFullError("\n".join(manager._broadcast(lines)))
    errors = [e for e, _ in gathered if e]
    if errors:
        raise CheckpointError(errors[0])


def disk_full_lines(root: str, step: int, tmp: str, full: int, keep_last: int) -> list[str]:
    """Rank 0, once no rank writes: remove the partial checkpoint, then say what failed, what is
    intact and the space: the cause first, the first line a user sees."""
    remove_tree(tmp)
    why = "the disk quota is exceeded (EDQUOT)" if full == errno.EDQUOT else "no space left on device (ENOSPC)"
    intact, space = intact_lines(root, step, full)
    return [f"disk full: checkpoint step {step} could not be written to {tmp[:-len('.tmp')]}: {why}; its partial "
            "files were removed", intact, f"{space}; free space there, or set checkpoint.dir to a larger filesystem "
            f"(checkpoint.keep_last={keep_last}: older checkpoints are deleted only once a new one is complete)"]


def intact_lines(root: str, before: int | None, full: int | None = None) -> list[str]:
    """Two lines: the latest complete checkpoint (before step `before`) that the same command
    resumes from, and the space a checkpoint needs (that one's size) against the free space."""
    found = [(s, p) for s, p in list_checkpoints(root) if before is None or s < before]
    usage = shutil.disk_usage(root if os.path.isdir(root) else os.path.dirname(root) or ".")
    have = f"{_size(usage.free)} free of {_size(usage.total)} on the filesystem of {root}"
    if full == errno.EDQUOT:
        have += " (your quota is what ran out: `quota -s` shows it)"
    if not found:
        return ["shardlab: no earlier complete checkpoint: the same command starts the run again from step 0",
                f"shardlab: {have}"]
    step, path = found[-1]
    try:
        need = sum(read_manifest(path).get("files", {}).values())
    except CheckpointError:
        need = 0
    return [f"shardlab: the previous checkpoint, step {step} ({path}), is intact: the same command resumes from it",
            f"shardlab: the next checkpoint needs about {_size(need)} (step {step}'s size); {have}"]


def full_filesystem_lines(run_dir: str, root: str, write_error: BaseException | None, remove_partial: bool
                          ) -> list[str]:
    """The launcher's view after its workers failed: [] unless the run directory's filesystem is
    full (under FULL_BELOW_BYTES free, or the launcher's own record met ENOSPC/EDQUOT), when the
    workers could not leave records saying so. `remove_partial`: no worker can be writing (one
    agent, all its workers ended): the torn `step_N.tmp/` directories are removed."""
    full = disk_full_errno(write_error)
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return []
    if full is None and free >= FULL_BELOW_BYTES:
        return []
    torn = [n for n in (os.listdir(root) if os.path.isdir(root) else []) if re.match(r"^step_\d{8,}\.tmp$", n)]
    if remove_partial:
        for name in torn:
            remove_tree(os.path.join(root, name))
    why = "the disk quota is exceeded (EDQUOT)" if full == errno.EDQUOT else f"{_size(free)} free"
    removed = f"; the partial checkpoint {', '.join(torn)} was removed" if torn and remove_partial else ""
    return [f"error: disk full: the filesystem of {run_dir} is full ({why}): the workers stopped without a "
            f"record of why{removed}", *intact_lines(root, None, full)]


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
