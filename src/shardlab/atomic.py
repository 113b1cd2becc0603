"""Files a reader never sees half written: `write_json_atomic` (run_args.json, metrics.json, a
checkpoint's manifest, the hang doctor's records), and `remove_tree` (a checkpoint deleted), and `read_json` (such a file, or None);
`disk_full_errno`, whether an error was a full filesystem (or quota). Standard library only, so the doctor's
reading side and the launchers use it without torch."""

from __future__ import annotations

import contextlib
import errno
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
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


#: a filesystem without space (ENOSPC) or a user over their quota (EDQUOT)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full_errno(exc: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT when `exc`, or an exception it was raised from or while handling, is an
    OSError of a full filesystem (torch.save reports one as "unexpected pos", raised while handling it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def read_json(path: str) -> Any:
    """A JSON file's content, or None where it is missing, unreadable or not (yet) JSON: the readers of
    files other processes write (markers, records, run files) treat all three as absent."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove_tree(path: str) -> None:
    """Rename first (atomic), so a crash mid-deletion leaves nothing that looks like a checkpoint."""
    doomed = f"{path}.deleting-{os.getpid()}"
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)
