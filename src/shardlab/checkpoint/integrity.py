"""Reading a checkpoint without trusting it: SHA-256 of every file against the manifest, and
DCP's pickled `.metadata` through an unpickler that admits only the classes metadata is made of."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from shardlab.checkpoint.format import DCP_METADATA, MANIFEST, CheckpointError, what_to_do

log = logging.getLogger("shardlab.checkpoint")

# ============================================================================ integrity
# [Note: what the hashes and the unpickler each guarantee]
# The manifest records every file's size and SHA-256 (computed after DCP finished writing,
# before the manifest and the rename). Sizes are checked whenever checkpoints are listed:
# a wrong size is what a torn save or a half-done non-atomic rename looks like, and such a
# directory is skipped. The hashes are checked when a checkpoint is loaded (they cost a read
# of every byte): a file whose content differs from what was saved (a bit flip on disk or in
# transfer, an edit) or a file nobody listed makes the load fail with a CheckpointError that
# names the file. A loader never falls back to another checkpoint by itself: training from an
# older state than the user believes is worse than stopping with an explanation.
# The hashes do not stop an attacker who can rewrite files, since the manifest can be
# rewritten too. What makes loading safe against a crafted checkpoint is that no byte of it
# can run code: `.metadata` goes through _MetadataUnpickler (an allowlist of DCP's own
# dataclasses, torch.Size, dtypes and layouts), tensors through torch.load(weights_only=True),
# and "bytes" entries (DCP would unpickle them freely) are refused.
HASH_KEY = "sha256"
_HASH_BLOCK = 4 << 20


def file_sha256(path: str) -> str:
    """SHA-256 (hex) of a file, read in blocks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is corrupt or was modified: {what}; {what_to_do(path)}")


def check_file_hashes(path: str, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """The load-time check: no file in `path` beyond the manifest's list, and the SHA-256 of
    each of `names` (default: every listed file) equal to the recorded one."""
    files = manifest.get("files", {})
    outside = [n for n in files if os.path.basename(n) != n or n in ("", ".", "..")]
    if outside:
        raise _corrupt(path, f"{MANIFEST} lists {outside[0]!r}, which is not a file of the checkpoint directory")
    unlisted = sorted(set(os.listdir(path)) - set(files) - {MANIFEST})
    if unlisted:
        raise _corrupt(path, f"file {unlisted[0]} is not listed in {MANIFEST}"
                             + (f" (nor are {unlisted[1:4]})" if len(unlisted) > 1 else ""))
    recorded = manifest.get(HASH_KEY)
    if recorded is None:
        # written before shardlab recorded hashes: still loaded (and still without running code)
        log.warning("checkpoint %s records no SHA-256 of its files (saved by an older shardlab): its content "
                    "cannot be verified", path)
        return
    for name in sorted(files) if names is None else names:
        expected = recorded.get(name)
        if not isinstance(expected, str):
            raise _corrupt(path, f"{MANIFEST} records no {HASH_KEY} for file {name}")
        actual = file_sha256(os.path.join(path, name))
        if actual != expected:
            raise _corrupt(path, f"file {name} has sha256 {actual}, expected {expected}")


def _expected_hash(path: str, manifest: dict[str, Any] | None, name: str) -> str | None:
    if manifest is None or manifest.get(HASH_KEY) is None:
        return None
    expected = manifest[HASH_KEY].get(name)
    if not isinstance(expected, str):
        raise _corrupt(path, f"{MANIFEST} records no {HASH_KEY} for file {name}")
    return expected



# ============================================================================ DCP metadata without code
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Everything a `.metadata` written by DCP refers to by name (found by recording the
    find_class calls of real files of every engine; tests/test_checkpoint_security.py keeps it
    complete): DCP's metadata dataclasses, its file-slice record, torch.Size, dtypes and
    layouts, and the path in StorageMeta.checkpoint_id. Each is a plain record or a constructor
    that only builds a value; none imports, opens, runs or evaluates anything."""
    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", n): getattr(_dcp_metadata, n)
        for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                  "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # torch.layout pickles as _get_layout("torch.strided"): a lookup in a table of layouts
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():  # every dtype pickles as the global torch.<name>
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    # Python >= 3.13 names the module of PosixPath pathlib._local; same class, same safety
    allowed[("pathlib", "PosixPath")] = allowed[("pathlib._local", "PosixPath")] = pathlib.PosixPath
    return allowed


_ALLOWED_GLOBALS = _metadata_globals()


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the names in _ALLOWED_GLOBALS. A pickle can run
    code only through the callables it names (GLOBAL/STACK_GLOBAL, and extension codes, all
    resolved by find_class) or through persistent ids (refused by the base class), so a file
    naming anything else (os.system, builtins.eval, ...) is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None


def read_dcp_metadata(path: str, manifest: dict[str, Any] | None = None) -> Metadata:
    """DCP's `.metadata` of checkpoint `path`, without running code from it: its bytes are
    checked against the manifest's SHA-256 (when given and recorded), unpickled through the
    allowlist, and their structure checked (tensor entries only; storage in listed files)."""
    fp = os.path.join(path, DCP_METADATA)
    try:
        with open(fp, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {DCP_METADATA} ({e})") from None
    expected = _expected_hash(path, manifest, DCP_METADATA)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        # the same bytes are hashed and unpickled: nothing can change between check and use
        raise _corrupt(path, f"file {DCP_METADATA} has sha256 {hashlib.sha256(data).hexdigest()}, expected {expected}")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(
            f"checkpoint {path}: {DCP_METADATA} refers to {e}, which DCP metadata never contains; refusing to "
            f"load it (nothing was run). The file was crafted to run code or is corrupt: do not use this checkpoint; "
            f"{what_to_do(path)}") from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle is a corrupt checkpoint
        raise _corrupt(path, f"{DCP_METADATA} is not valid DCP metadata ({type(e).__name__}: {e})") from None
    problem = _metadata_problem(md, None if manifest is None else set(manifest.get("files", {})))
    if problem:
        raise _corrupt(path, f"{DCP_METADATA} {problem}")
    return md


def _metadata_problem(md: Any, files: set[str] | None) -> str | None:
    """What is wrong with unpickled metadata (allowed classes can still be put together in ways
    DCP would trip over, or point outside the checkpoint); None when it is well formed."""
    def size_ok(s: Any) -> bool:
        return isinstance(s, torch.Size) and all(isinstance(d, int) and d >= 0 for d in s)

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        return f"holds a {type(md).__name__}, not a DCP Metadata with entries and storage"
    for fqn, tm in md.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(tm, TensorStorageMetadata):
            return f"entry {fqn!r} is a {type(tm).__name__}: shardlab checkpoints hold tensors only"
        if not (isinstance(tm.properties, TensorProperties) and isinstance(tm.properties.dtype, torch.dtype)
                and size_ok(tm.size) and isinstance(tm.chunks, list)):
            return f"entry {fqn!r} has malformed tensor properties"
        for c in tm.chunks:
            if not (isinstance(c, ChunkStorageMetadata) and size_ok(c.offsets) and size_ok(c.sizes)
                    and len(c.offsets) == len(c.sizes) == len(tm.size)):
                return f"entry {fqn!r} has a malformed chunk"
    for index, info in md.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _dcp_filesystem._StorageInfo)):
            return "has a malformed storage record"
        rel = info.relative_path
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", "..") \
                or (files is not None and rel not in files):
            return f"points entry {index.fqn!r} at {rel!r}, not a data file listed in {MANIFEST}"
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0) or getattr(info, "transform_descriptors", None):
            return f"has a malformed storage record for {index.fqn!r}"
    return None


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose read_metadata goes through read_dcp_metadata. It reads
    (and verifies) once and returns that same metadata to DCP's later calls.

    [Note: read before dcp.load] Callers call read_metadata() themselves before dcp.load:
    inside dcp.load a failing read_metadata is logged with its traceback and retried as
    rank-local metadata, so errors must surface earlier, as a CheckpointError. The
    signature takes no **kwargs on purpose: DCP tries rank-local metadata only on readers
    whose read_metadata accepts keyword arguments."""

    def __init__(self, path: str, manifest: dict[str, Any] | None = None):
        super().__init__(path)
        self._manifest = manifest
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self._metadata is None:
            self._metadata = read_dcp_metadata(str(self.path), self._manifest)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one data file at a time, so that bytes which are not the tensors DCP wrote
        name their file: a file replaced and its hash recorded anew passes check_file_hashes,
        and only parsing it tells."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except _UNPARSABLE as e:
                raise _corrupt(str(self.path), f"file {name} matches its recorded {HASH_KEY}, but its tensor data "
                                               f"cannot be read ({_first_sentence(e)})") from e
        done: Future[None] = Future()
        done.set_result(None)
        return done


# What torch.load raises on bytes that are not a tensor torch.save wrote (measured on random,
# zeroed, truncated and partly overwritten data): weights_only's UnpicklingError, the zip
# reader's RuntimeError, EOFError on an empty slice, ValueError on a bad seek.
_UNPARSABLE = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError)


def _first_sentence(e: BaseException) -> str:
    """An exception's type and the first sentence of its message: torch.load's weights-only error
    goes on for a dozen lines about trusted sources, none of which applies to a damaged file."""
    text = str(e).strip().split("\n", 1)[0].split(". ", 1)[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def dcp_load(state: dict[str, Any], reader: SafeReader, planner: LoadPlanner, *, no_dist: bool) -> None:
    """dcp.load, where a CheckpointError raised by a rank's read comes out as itself: dcp.load
    wraps what the ranks raised in a CheckpointException, a BaseException whose text is every
    rank's traceback. Anything else is no known checkpoint problem and goes on as it came."""
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as e:
        for failure, _ in e.failures.values():
            if isinstance(failure, CheckpointError):
                raise failure from None
        raise
