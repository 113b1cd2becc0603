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
an unpickler that admits only the classes DCP's metadata is made of (`_SafeReader`), the
data files are read by `torch.load(weights_only=True)`, and every file's SHA-256 is checked
against the manifest before anything is read (see "Security and integrity" in the docs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import pathlib
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardlab.engines.api import ShardPiece, engine_of
from shardlab.metrics import write_json_atomic
from shardlab.models import model_record
from shardlab.runtime import all_gather_object

log = logging.getLogger("shardlab.checkpoint")

FORMAT = "shardlab-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "shardlab.json"
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which one, what is wrong and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ============================================================================ what a rank holds
def _flat_local(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of the elements this rank stores for `t` (a DTensor's local shard), sharing
    storage, detached: DCP loads in place through it."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.view(-1)


def checkpoint_layout(model: nn.Module) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
    """For each local (optimizer-visible) parameter, the contiguous pieces of original parameters
    it holds, in flattened-element offsets (see ShardPiece): each engine's `shard_layout()`."""
    return engine_of(model).shard_layout()


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, m in module.named_modules():
        for attr, b in m._buffers.items():
            if b is not None and attr not in m._non_persistent_buffers_set:
                yield (f"{mod_name}.{attr}" if mod_name else attr), b


def _model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state_dict name. Every engine keeps them replicated in the user's modules."""
    out = {}
    for name, b in _persistent_buffers(engine_of(model).unwrapped()):
        if b.numel() and b.untyped_storage().nbytes() < b.numel() * b.element_size():
            raise CheckpointError(f"buffer {name!r} has no storage between steps in the "
                                  f"{engine_of(model).strategy} engine; checkpointing it is not supported")
        out[name] = b.detach()
    return out


# ============================================================================ RNG states
def capture_rng(rank: int) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors under rng/<rank>/ (DCP-storable, no pickling)."""
    p = f"rng/{rank}/"
    out = {p + "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{p}cuda/{i}"] = s
    version, internal, gauss = random.getstate()
    out[p + "python"] = torch.tensor([version, *internal], dtype=torch.int64)
    out[p + "python_gauss"] = torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out[p + "numpy"] = torch.from_numpy(keys.astype(np.int64))
    out[p + "numpy_extra"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return out


def restore_rng(rank: int, tensors: dict[str, torch.Tensor]) -> None:
    p = f"rng/{rank}/"
    torch.set_rng_state(tensors[p + "torch"])
    cuda = sorted((k for k in tensors if k.startswith(p + "cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda][:torch.cuda.device_count()])
    py = tensors[p + "python"].tolist()
    has_gauss, gauss = tensors[p + "python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has_gauss else None))
    pos, np_has_gauss, cached = tensors[p + "numpy_extra"].tolist()
    np.random.set_state(("MT19937", tensors[p + "numpy"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), cached))


# ============================================================================ DCP planners
@dataclasses.dataclass
class _Piece:
    """One contiguous range of a flattened tensor `fqn` (of full_numel elements) on this rank."""

    fqn: str
    offset: int
    full_numel: int
    data: torch.Tensor  # 1-D, numel elements, a view into the live tensor (or a staged copy)


class _FlatPieceSavePlanner(DefaultSavePlanner):
    """The default planner for ordinary entries, plus one SHARD write item per flat piece.

    [Note: why a planner and not ShardedTensor/DTensor] A piece is an arbitrary contiguous
    range: FSDP flat shards cut parameters anywhere and ZeRO-3 owns whole tensors. DTensor
    can only express torch.chunk-style even splits; ShardedTensor is deprecated and needs
    one collective per tensor to build. DCP's own chunk metadata (offsets, sizes) expresses
    the ranges directly, and its global-plan validation checks that the chunks of every
    tensor cover it exactly once, so a wrong layout fails the save instead of writing garbage.
    """

    def __init__(self, pieces: list[_Piece]):
        super().__init__()
        self.pieces = {(p.fqn, p.offset): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for p in self.pieces.values():
            items.append(WriteItem(
                index=MetadataIndex(p.fqn, torch.Size([p.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.data.numel()])),
                    properties=TensorProperties.create_from_tensor(p.data),
                    size=torch.Size([p.full_numel])),
            ))
        mappings = dict(plan.planner_data or {})
        mappings.update({p.fqn: (p.fqn,) for p in self.pieces.values()})
        self.plan = dataclasses.replace(plan, items=plan.items + items, planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.SHARD and index.offset is not None and len(index.offset) == 1:
            piece = self.pieces.get((index.fqn, index.offset[0]))
            if piece is not None:
                return piece.data
        return super().resolve_data(write_item)


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus the one path that unpickles freely: a "bytes" entry is
    read by `torch.load(weights_only=False)`. shardlab saves tensors only, and `_SafeReader`
    already refuses metadata that declares bytes entries; this refuses them a second time."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, which shardlab "
                              "never saves; refusing to unpickle it (the checkpoint was not written by shardlab)")


class _FlatPieceLoadPlanner(_TensorOnlyLoadPlanner):
    """Reads each flat piece this rank holds from whichever saved chunks overlap it (resharding)."""

    def __init__(self, pieces: list[_Piece]):
        super().__init__()
        self.pieces = {(p.fqn, p.offset): p for p in pieces}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for p in self.pieces.values():
            md = self.metadata.state_dict_metadata.get(p.fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (p.full_numel,):
                raise CheckpointError(f"checkpoint entry {p.fqn!r} is {getattr(md, 'size', 'missing')}, "
                                      f"expected a flat tensor of {p.full_numel} elements")
            chunk = ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.data.numel()]))
            items += create_read_items_for_chunk_list(p.fqn, md, [chunk])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and len(index.offset) == 1:
            piece = self.pieces.get((index.fqn, index.offset[0]))
            if piece is not None:
                return piece.data
        return super().lookup_tensor(index)


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


def _what_to_do(path: str) -> str:
    """The way out when checkpoint `path` cannot be used: name the previous complete checkpoint."""
    path = os.path.abspath(path.rstrip("/"))
    m = _STEP_DIR.match(os.path.basename(path))
    earlier = [p for s, p in list_checkpoints(os.path.dirname(path))
               if m and s < int(m.group(1)) and os.path.abspath(p) != path]
    if earlier:
        return (f"delete it (or move it out of {os.path.dirname(path)}) and resume from the previous complete "
                f"checkpoint, {earlier[-1]} (checkpoint.resume=auto then picks it), or restore the file from a copy")
    return "delete it and restore the checkpoint from a copy; no earlier complete checkpoint exists beside it"


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is corrupt or was modified: {what}; {_what_to_do(path)}")


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
            f"{_what_to_do(path)}") from None
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


class _SafeReader(FileSystemReader):
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


def verify_checkpoint(path: str, *, hashes: bool = False) -> dict[str, Any]:
    """Check that `path` is a complete checkpoint (every listed file there at its listed size;
    cheap: stats only) and, with hashes=True, intact (check_file_hashes: reads every byte);
    return its manifest."""
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
    if hashes:
        check_file_hashes(path, manifest)
    return manifest


def list_checkpoints(root: str, *, complete_only: bool = True) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints under `root`, oldest first; torn or corrupted ones skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        if complete_only:
            try:
                verify_checkpoint(path)
            except CheckpointError as e:
                log.warning("skipping %s", e)
                continue
        found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a checkpoint, a checkpoints directory or a run directory."""
    if os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, DCP_METADATA)) \
            or _STEP_DIR.match(os.path.basename(path.rstrip("/"))) or path.rstrip("/").endswith(".tmp"):
        verify_checkpoint(path)
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = list_checkpoints(root)
        if found:
            return found[-1][1]
    raise CheckpointError(f"no complete checkpoint under {path}; train with checkpoint.every_steps=N to write "
                          "some (a run directory, its checkpoints/ directory or a step_* directory is accepted)")


def read_tensors(path: str, prefix: str = "", *, manifest: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor whose key starts with `prefix` as a full tensor, in this process alone
    (no process group): DCP reassembles each from the chunks all ranks wrote. The checkpoint
    is verified first (sizes and SHA-256 of every file) unless its already verified manifest
    is given."""
    if manifest is None:
        manifest = verify_checkpoint(path, hashes=True)
    reader = _SafeReader(path, manifest)
    md = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix)}
    try:
        with warnings.catch_warnings():  # DCP warns that no process group exists: that is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=_TensorOnlyLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"reading checkpoint {path} failed ({type(e).__name__}: {e}); it is damaged: "
                              f"{_what_to_do(path)}") from e
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
                              f"{e}); the checkpoint is damaged: {_what_to_do(path)}") from None
    return out, manifest


# ============================================================================ model description
def build_model_from_record(record: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """The checkpointed architecture (shardlab.models.rebuild_model), without the training data."""
    from shardlab.models import rebuild_model

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


# ============================================================================ the manager
class CheckpointManager:
    """Saves and restores the whole training state; every rank calls every method.

    [Note: every rank calls] Saving and loading run collectives (DCP's plan exchange, the
    agreement on which checkpoint to load, error propagation). A rank that skipped one would
    leave the others blocked until the timeout, so nothing here is `if rank == 0` except
    plain file operations (the manifest, the rename, pruning), and errors found on one rank
    are shared so that all ranks raise together instead of some waiting forever.
    """

    def __init__(self, root: str, rt: Any, *, every_steps: int = 0, keep_last: int = 2, resume: str = "auto",
                 async_save: bool = False, timeout_s: float = 300.0, config: Any = None):
        self.root = root
        self.rt = rt
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.resume = resume
        self.async_save = async_save
        self.config = config
        self.last_saved_step: int | None = None
        self.last_save_seconds: float | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._commit_error: BaseException | None = None
        self._commit_done = threading.Event()
        self._shapes: dict[str, list[int]] | None = None
        self._group = None
        if async_save and self._distributed:
            # [Note: async group] The background save runs DCP's collectives (plan gather,
            # metadata scatter) while the training thread runs its own all-reduces. On one
            # gloo group they interleave in different orders on different ranks and hang (seen
            # with DDP on gloo); a group of its own keeps the two streams apart. Every rank
            # creates it here, at the same point of the program.
            import datetime

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @classmethod
    def from_config(cls, cfg: Any, out_dir: str, rt: Any) -> CheckpointManager:
        c = cfg.checkpoint
        return cls(c.dir or os.path.join(out_dir, "checkpoints"), rt, every_steps=c.every_steps,
                   keep_last=c.keep_last, resume=c.resume, async_save=c.async_save,
                   timeout_s=cfg.parallel.timeout_s, config=cfg)

    # -- collectives ------------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.rt.world_size > 1

    def _all_gather(self, obj: Any) -> list[Any]:
        return all_gather_object(obj, self.rt)

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, error: str | None) -> None:
        """Raise the same CheckpointError on every rank if any rank found a problem."""
        errors = [e for e in self._all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])

    def _param_shapes(self, layout) -> dict[str, list[int]]:
        """Every original parameter's full shape, over all ranks (a rank may hold none of one)."""
        if self._shapes is None:
            local = {pc.name: list(pc.full_shape) for _, pieces in layout for pc in pieces}
            merged: dict[str, list[int]] = {}
            for d in self._all_gather(local):
                merged.update(d)
            self._shapes = dict(sorted(merged.items()))
        return self._shapes

    # -- the training loop's interface ------------------------------------------------------------
    def maybe_resume(self, model: nn.Module, opt, sched, state) -> str | None:
        """Load the checkpoint `checkpoint.resume` names: auto = the latest complete one under
        the checkpoint dir if any (so a restarted worker group continues), none, or a path."""
        if self.resume == "none":
            return None
        if self.resume == "auto":
            found = list_checkpoints(self.root) if self.rt.rank == 0 else None
            path = self._broadcast(found[-1][1] if found else None)
            if path is None:
                return None
        else:
            path = self.resume
        self.load(path, model, opt, sched, state)
        return path

    def maybe_save(self, model: nn.Module, opt, sched, state) -> str | None:
        if self.every_steps > 0 and state.step % self.every_steps == 0 and state.step != self.last_saved_step:
            self._refuse_non_finite(model, state.step)
            return self.save(model, opt, sched, state)
        return None

    def _refuse_non_finite(self, model: nn.Module, step: int) -> None:
        """The loss of step s is computed before step s's update, so a non-finite gradient turns
        the parameters to NaN one step before the loss shows it. Saving them would replace the
        last good checkpoint by a poisoned one: check first (all ranks decide together)."""
        bad = [n for p, ps in checkpoint_layout(model) for n in [ps[0].name if ps else "(padding)"]
               if not torch.isfinite(_flat_local(p)).all()]
        if any(self._all_gather(bool(bad))):
            last = self.last_saved_step
            raise FloatingPointError(
                f"non-finite parameters at step {step} (e.g. {bad[:3] or 'on another rank'}): checkpoint not "
                f"written; the last good checkpoint is step {last} in {self.root}. Lower train.lr or enable "
                "train.grad_clip, then resume from it.")

    def finalize(self, model: nn.Module, opt, sched, state) -> str | None:
        """At the end of training: the final state is saved (when checkpointing is on) and
        every in-flight asynchronous save is committed."""
        path = None
        if self.every_steps > 0 and state.step != self.last_saved_step:
            path = self.save(model, opt, sched, state, blocking=True)
        self.wait()
        return path

    # -- save -------------------------------------------------------------------------------------
    def _collect(self, model: nn.Module, opt, state, stage: bool):
        """(plain entries, flat pieces, description) of what this rank saves. stage=True copies
        everything, so training may modify the live tensors while a background save writes."""
        copy = (lambda t: t.detach().clone()) if stage else (lambda t: t.detach())
        layout = checkpoint_layout(model)
        shapes = self._param_shapes(layout)
        plain: dict[str, torch.Tensor] = {}
        pieces: list[_Piece] = []
        tensor_keys: set[str] = set()
        scalar_keys: set[str] = set()
        for p, ps in layout:
            flat = _flat_local(p)
            st = opt.state.get(p, {}) if opt is not None else {}
            for pc in ps:
                numel = math.prod(pc.full_shape)
                pieces.append(_Piece(f"model/{pc.name}", pc.offset, numel,
                                     copy(flat[pc.local_start:pc.local_start + pc.numel])))
                for key, v in st.items():
                    fqn = f"optim/{pc.name}/{key}"
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        plain[fqn] = copy(v)
                        scalar_keys.add(key)
                    elif isinstance(v, torch.Tensor) and _flat_local(v).numel() == flat.numel():
                        sflat = _flat_local(v)
                        pieces.append(_Piece(fqn, pc.offset, numel, copy(sflat[pc.local_start:pc.local_start + pc.numel])))
                        tensor_keys.add(key)
                    else:
                        raise CheckpointError(f"optimizer state {key!r} of {pc.name!r} is a {type(v).__name__}: "
                                              "only tensors shaped like the parameter and 0-dim tensors are saved")
        buffers = _model_buffers(model)
        for name, b in buffers.items():
            plain[f"model/{name}"] = copy(b)
        plain.update(capture_rng(self.rt.rank))
        desc = {"params": shapes, "buffers": {k: list(b.shape) for k, b in buffers.items()},
                "optim_tensor_keys": sorted(tensor_keys), "optim_scalar_keys": sorted(scalar_keys)}
        return plain, pieces, desc

    def _manifest(self, model, opt, sched, state, desc_all: list[dict], world_size: int) -> dict[str, Any]:
        desc = desc_all[0]
        record = None  # what it takes to rebuild the model without the training data (export, generate)
        if self.config is not None:
            record = model_record(self.config.model.name, engine_of(model).unwrapped(), self.config.seed)
        sched_state = None
        if sched is not None:
            sched_state = {k: v for k, v in sched.state_dict().items() if _jsonable(v)}
        return {
            "format": FORMAT, "version": FORMAT_VERSION,
            "step": state.step,
            "world_size": world_size,
            "strategy": engine_of(model).strategy,
            "params": desc["params"],
            "buffers": desc["buffers"],
            "state_dict_keys": _state_dict_keys(record),
            "optimizer": None if opt is None else {
                "class": type(opt).__name__,
                "param_groups": [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in opt.param_groups],
                "tensor_keys": sorted({k for d in desc_all for k in d["optim_tensor_keys"]}),
                "scalar_keys": sorted({k for d in desc_all for k in d["optim_scalar_keys"]}),
            },
            "scheduler": sched_state,
            "train_state": dataclasses.asdict(state),  # TrainState: JSON values only
            "rng_world_size": world_size,
            "model": record,
            "config": self.config.to_dict() if self.config is not None else None,
            "saved_unix_time": time.time(),
        }

    def save(self, model: nn.Module, opt, sched, state, *, blocking: bool | None = None) -> str:
        """Write a checkpoint of step `state.step`. Synchronous unless checkpoint.async (then it
        returns once the state is copied; the write and commit finish in the background)."""
        blocking = (not self.async_save) if blocking is None else blocking
        self.wait()  # one save in flight at most: its commit must precede pruning by the next
        t0 = time.perf_counter()
        final = os.path.join(self.root, step_dir_name(state.step))
        tmp = final + ".tmp"
        error = None
        if self.rt.rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                if os.path.exists(tmp):  # torn by an earlier crash at this same step
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
            except OSError as e:
                error = f"cannot create checkpoint directory {tmp}: {e}"
        self._agree(error)  # also the barrier: nobody writes into tmp before it is fresh
        plain, pieces, desc = self._collect(model, opt, state, stage=not blocking)
        desc_all = self._all_gather(desc)
        manifest = self._manifest(model, opt, sched, state, desc_all, self.rt.world_size)
        planner = _FlatPieceSavePlanner(pieces)
        writer = FileSystemWriter(tmp, sync_files=True)
        step = state.step
        if blocking:
            try:
                dcp.save(plain, storage_writer=writer, planner=planner, no_dist=not _dist_ready())
            except Exception as e:
                raise CheckpointError(f"rank {self.rt.rank}: saving checkpoint step {step} failed ({e}); if another "
                                      "rank died, its log says why; the previous checkpoint is intact") from e
            hashes, hash_s = self._hash_own_files(tmp)
            error = self._commit(tmp, final, manifest, t0, hashes, hash_s) if self.rt.rank == 0 else None
            self._agree(error)
            self.last_saved_step = step
            return final
        fut = dcp.async_save(plain, storage_writer=writer, planner=planner, process_group=self._group)
        self._pending, self._pending_step = fut, step
        self._commit_error = None
        self._commit_done.clear()
        if self.rt.rank == 0:
            # DCP's coordinator writes .metadata only after every rank reported its writes done,
            # so when rank 0's future resolves the data of all ranks is on disk: commit right away.
            def on_done(f: Future) -> None:
                try:
                    f.result()
                    err = self._commit(tmp, final, manifest, t0)
                    if err:
                        self._commit_error = CheckpointError(err)
                except BaseException as e:  # noqa: BLE001 - reported by wait()
                    self._commit_error = e
                finally:
                    self._commit_done.set()
            fut.add_done_callback(on_done)
        else:
            self._commit_done.set()
        self.last_saved_step = step
        return final

    def wait(self) -> None:
        """Finish the in-flight asynchronous save (every rank calls); raise if it failed anywhere."""
        if self._pending is None:
            return
        fut, step = self._pending, self._pending_step
        self._pending = None
        error = None
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001
            error = f"rank {self.rt.rank}: asynchronous save of step {step} failed: {e}"
        self._commit_done.wait()
        if error is None and self._commit_error is not None:
            error = f"committing checkpoint step {step} failed: {self._commit_error}"
        self._agree(error)

    def _hash_own_files(self, tmp: str) -> tuple[dict[str, str], float]:
        """After a synchronous save, every rank hashes the data files it wrote itself (DCP names
        them __<rank>_<i>.distcp), in parallel and from its own page cache; rank 0 receives all
        (the gather is collective: every rank calls). Rank 0's commit hashes whatever is left
        (.metadata; everything, should DCP ever name files otherwise). Returns the hashes and
        the slowest rank's hashing seconds."""
        t0 = time.perf_counter()
        own = re.compile(rf"^__{self.rt.rank}_\d+\.distcp$")
        mine: dict[str, str] | str = {}
        try:
            mine = {n: file_sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if own.match(n)}
        except OSError as e:
            mine = f"rank {self.rt.rank}: hashing its checkpoint files in {tmp} failed: {e}"
        gathered = self._all_gather((mine, time.perf_counter() - t0))
        self._agree(next((m for m, _ in gathered if isinstance(m, str)), None))
        return {k: v for m, _ in gathered for k, v in m.items()}, max(s for _, s in gathered)

    def _commit(self, tmp: str, final: str, manifest: dict[str, Any], t0: float,
                hashes: dict[str, str] | None = None, hash_s: float = 0.0) -> str | None:
        """Rank 0, after every rank's data is written: manifest last, then the atomic rename.

        [Note: atomicity] Until the rename the checkpoint exists only as step_N.tmp, which no
        reader accepts. The manifest is written (and fsynced) inside tmp after DCP's .metadata,
        which DCP writes only once all ranks finished; it lists every file with its size. So a
        crash at any moment leaves either no step_N or a complete one, and a directory that a
        non-atomic rename (object stores) or a deletion left half-there fails the size check.
        The SHA-256 of every file goes in the manifest too (checked on load). Old checkpoints
        are pruned only after the new one is in place.
        """
        try:
            if not os.path.exists(os.path.join(tmp, DCP_METADATA)):
                return f"checkpoint {tmp}: DCP wrote no {DCP_METADATA}; not committed"
            manifest = dict(manifest)
            names = sorted(os.listdir(tmp))
            manifest["files"] = {n: os.path.getsize(os.path.join(tmp, n)) for n in names}
            t_hash = time.perf_counter()
            hashes = hashes or {}
            manifest[HASH_KEY] = {n: hashes.get(n) or file_sha256(os.path.join(tmp, n)) for n in names}
            manifest["hash_seconds"] = hash_s + time.perf_counter() - t_hash
            manifest["save_seconds"] = time.perf_counter() - t0
            write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
            _fsync_dir(tmp)
            if os.path.exists(final):
                _remove_tree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self.last_save_seconds = manifest["save_seconds"]
            self._prune(manifest["step"])
        except OSError as e:
            return f"committing checkpoint {final} failed: {e}"
        return None

    def _prune(self, newest: int) -> None:
        complete = list_checkpoints(self.root)
        for _, path in complete[:-self.keep_last]:
            _remove_tree(path)
        for name in os.listdir(self.root):  # saves torn by earlier crashes
            m = re.match(r"^step_(\d{8,})\.tmp$", name)
            if m and int(m.group(1)) < newest:
                _remove_tree(os.path.join(self.root, name))

    # -- load -------------------------------------------------------------------------------------
    def _hash_error(self, path: str, manifest: dict[str, Any]) -> str | None:
        """Every rank hashes a share of the files (the whole checkpoint is read once, in parallel);
        the result goes through _agree, so all ranks stop together on a mismatch."""
        names = sorted(manifest.get("files", {}))[self.rt.rank::self.rt.world_size]
        try:
            check_file_hashes(path, manifest, names)
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return f"rank {self.rt.rank}: cannot read checkpoint {path} to verify it ({e})"
        return None

    def load(self, path: str, model: nn.Module, opt, sched, state) -> dict[str, Any]:
        """Restore everything from checkpoint `path` (a step dir, checkpoints dir or run dir)
        into this engine at this world size; every rank calls it."""
        self.wait()
        error, found = None, None
        if self.rt.rank == 0:
            try:
                found = resolve_checkpoint(path)
            except CheckpointError as e:
                error = str(e)
        self._agree(error)
        path = self._broadcast(found)
        manifest = None
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as e:
            error = (f"rank {self.rt.rank} cannot read {path} ({e}): the checkpoint directory must be on a "
                     "filesystem every node shares (NFS, Lustre, a GCS FUSE mount)")
        self._agree(error)
        self._agree(self._hash_error(path, manifest))

        layout = checkpoint_layout(model)
        shapes = self._param_shapes(layout)
        self._agree(_compatibility_error(path, manifest, shapes, _model_buffers(model), opt))
        reader = _SafeReader(path, manifest)
        try:
            md = reader.read_metadata().state_dict_metadata
        except CheckpointError as e:
            error = str(e)
        self._agree(error)

        pieces: list[_Piece] = []
        plain: dict[str, torch.Tensor] = {}
        new_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        om = manifest["optimizer"]
        has_optim = opt is not None and om is not None and (om["tensor_keys"] or om["scalar_keys"])
        first_name = next(iter(manifest["params"]))
        for p, ps in layout:
            flat = _flat_local(p)
            for pc in ps:
                pieces.append(_Piece(f"model/{pc.name}", pc.offset, math.prod(pc.full_shape),
                                     flat[pc.local_start:pc.local_start + pc.numel]))
            if not has_optim:
                continue
            st: dict[str, torch.Tensor] = {}
            for key in om["tensor_keys"]:
                st[key] = torch.zeros_like(p.detach())
                sflat = _flat_local(st[key])
                for pc in ps:
                    pieces.append(_Piece(f"optim/{pc.name}/{key}", pc.offset, math.prod(pc.full_shape),
                                         sflat[pc.local_start:pc.local_start + pc.numel]))
            for key in om["scalar_keys"]:
                # a local parameter holding only padding has no name of its own: its scalars
                # (Adam's step) equal every other parameter's, take the first one's
                fqn = f"optim/{ps[0].name if ps else first_name}/{key}"
                smd = md[fqn]
                st[key] = torch.empty(smd.size, dtype=smd.properties.dtype)
                plain[fqn] = st[key]
            new_state[p] = st
        for name, b in _model_buffers(model).items():
            plain[f"model/{name}"] = b
        rng_keys = [k for k in md if k.startswith(f"rng/{self.rt.rank}/")]
        for k in rng_keys:
            plain[k] = torch.empty(md[k].size, dtype=md[k].properties.dtype)
        try:
            with torch.no_grad():
                dcp.load(plain, storage_reader=reader, planner=_FlatPieceLoadPlanner(pieces),
                         no_dist=not _dist_ready())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"rank {self.rt.rank}: loading checkpoint {path} failed: {e}") from e

        if has_optim:
            for p, st in new_state.items():
                opt.state[p] = st
        if opt is not None and om is not None:
            _restore_param_groups(opt, om["param_groups"], path)
        if sched is not None and manifest.get("scheduler"):
            sched.load_state_dict(manifest["scheduler"])
            if opt is not None:  # LambdaLR.load_state_dict leaves the optimizer's lr alone
                for g, lr in zip(opt.param_groups, sched.get_last_lr()):
                    g["lr"] = lr
        if state is not None:
            for key, value in manifest["train_state"].items():  # older manifests lack newer fields
                setattr(state, key, value)
        if rng_keys:
            restore_rng(self.rt.rank, plain)
        elif self.rt.rank == 0 or self.rt.rank >= manifest["rng_world_size"]:
            log.warning("checkpoint %s has no RNG state for rank %d (saved at world size %d): this rank keeps "
                        "its seeded RNG", path, self.rt.rank, manifest["rng_world_size"])
        self.last_saved_step = manifest["step"]
        if self.rt.rank == 0:
            log.info("resumed from %s (step %d, saved by %s at world size %d)", path, manifest["step"],
                     manifest["strategy"], manifest["world_size"])
        return manifest


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _remove_tree(path: str) -> None:
    """Rename first (atomic), so a crash mid-deletion leaves nothing that looks like a checkpoint."""
    doomed = f"{path}.deleting-{os.getpid()}"
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def _compatibility_error(path: str, manifest: dict[str, Any], shapes: dict[str, list[int]],
                         buffers: dict[str, torch.Tensor], opt) -> str | None:
    saved = manifest["params"]
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    if missing or unexpected:
        return (f"checkpoint {path} does not fit this model: parameters missing from the checkpoint: "
                f"{missing[:5]}{'...' if len(missing) > 5 else ''}; parameters the model lacks: "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (was it written for another model.* config?)")
    wrong = [f"{n}: checkpoint {saved[n]} vs model {s}" for n, s in shapes.items() if list(saved[n]) != list(s)]
    wrong += [f"{n}: checkpoint {manifest['buffers'].get(n)} vs model {list(b.shape)}" for n, b in buffers.items()
              if manifest["buffers"].get(n) != list(b.shape)]
    if wrong:
        return (f"checkpoint {path} does not fit this model: model shape mismatch: {'; '.join(wrong[:5])}"
                f"{' ...' if len(wrong) > 5 else ''}; use the model.* config it was trained with")
    om = manifest["optimizer"]
    if opt is not None and om is not None and om["class"] != type(opt).__name__:
        return (f"checkpoint {path} holds {om['class']} state but the optimizer is {type(opt).__name__}; "
                "set train.optimizer as when it was saved")
    if opt is not None and om is not None and len(om["param_groups"]) != len(opt.param_groups):
        return f"checkpoint {path} has {len(om['param_groups'])} optimizer param groups, the optimizer {len(opt.param_groups)}"
    return None


def _restore_param_groups(opt, saved: list[dict[str, Any]], path: str) -> None:
    """The learning rate is state (the schedule moves it); the other hyperparameters come from
    the config, and a difference from the checkpoint's is reported, not silently overridden."""
    for g, s in zip(opt.param_groups, saved):
        for k, v in s.items():
            if k in ("lr", "initial_lr"):
                g[k] = v
            elif k in g and _norm(g[k]) != _norm(v):
                log.warning("resuming from %s: optimizer %s is %r now, %r in the checkpoint; using %r", path, k,
                            g[k], v, g[k])


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
