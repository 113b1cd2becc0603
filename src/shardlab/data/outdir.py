"""The output side of `shardlab prepare`: the lock on --out, the temporary folder beside it
that becomes DATA_DIR by one rename, the leftovers of killed prepares, the manifest's writing
(data/prepare.py's module docstring says how they fit together)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile

from shardlab.data.shards import MANIFEST, DataError


def make_tmp(out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out))
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the corpus from other users of a shared mount
    return tmp


@contextlib.contextmanager
def out_lock(out: str, wait: bool):
    """Hold `.NAME.lock` beside --out for the whole prepare: a second prepare into the same
    --out is refused at its start (or waits, with `wait`). The lock is the kernel's (flock), so
    a killed prepare holds nothing."""
    import fcntl

    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(parent, f".{name}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DataError(f"--out {out!r}: another prepare (pid {owner}) is writing it; wait for it to end or "
                            "choose another --out") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its previous holder removed the file meanwhile: lock the one now there
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def remove_leftovers(out: str) -> None:
    """Delete the temporary folders of prepares into `out` that were killed (called under out_lock,
    so none of them is still being written), saying so."""
    parent, name = os.path.split(os.path.abspath(out))
    for tmp in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*"))):
        print(f"prepare: removing {tmp}, the partial output of an interrupted prepare into {out}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(tmp: str, manifest: dict) -> None:
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w") as f:  # a top-level key a line, each value by json's C encoder (indent= is pure
        # Python: 0.8 s for the manifest of 20,000 inputs)
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in manifest.items()) + "\n}\n")
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


