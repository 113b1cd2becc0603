"""Prepared token shards on disk: the format, the manifest that is the contract between
`shardlab prepare` (data/prepare.py) and training, its checks, and the memory-mapped dataset.

A prepared DATA_DIR holds, per split (train, val):
    <split>-NNNNN.bin   the tokens: uint8 (bytes), little-endian uint16 (vocab <= 65536) or uint32, no
                        header; the manifest's dtype says which (corpora of bytes before uint8 are uint16)
    <split>-NNNNN.idx   int64 little-endian: the end offset (exclusive, in tokens) of every
                        document that ends in that shard, its end-of-document token included
    manifest.json       written last: format and version, tokenizer identity and hash, vocab
                        size, dtype, token and document counts, SHA-256 of every file, inputs
    tokenizer/          a copy of the tokenizer's files (not for bytes), so the directory alone
                        decodes its ids: runs copy it beside their checkpoints, `generate` reads it
The stream a split trains on is its shards concatenated in manifest order. Nothing else
in the directory is read; a directory without manifest.json is not a prepared corpus.

[Note: verifying shards] A shard's SHA-256 is what the manifest promises, but hashing costs
about a second per GB here (measured 1.0 GB/s on this machine's SHA-NI core). So every start
checks every file's size, and the full hash runs only when this machine has not verified this
manifest with these files before: a marker under the cache (SHARDLAB_CACHE) records the
manifest hash with each file's size, mtime and inode, written after a full check (and by
prepare, which hashes what it writes). A file rewritten in place gets a new mtime and is
hashed again; an edit that restores size and mtime is the one thing only a full check sees
(`verify_data_dir(path, full=True)`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "shardlab-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: Where a DATA_DIR keeps its copy of the tokenizer (manifest: tokenizer.copy).
TOKENIZER_COPY = "tokenizer"
SPLITS = ("train", "val")
INDEX_DTYPE = np.dtype("<i8")
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
RELEASE_BLOCK = 2 << 20  # see [Note: constant RSS]


class DataError(ValueError):
    """Data that cannot be used; the message names the file or key and what to do."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest of uint8 / uint16 / uint32 that holds every token id (bytes: uint8; GPT-2: uint16, as nanoGPT)."""
    if vocab_size <= 2**8:
        return np.dtype("u1")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _prepare_hint(path: str, key: str = "data.path") -> str:
    name = os.path.basename(os.path.normpath(path))
    if ".tmp-" in name and name.startswith("."):
        return "it is the partial output of an interrupted `shardlab prepare`: delete it and prepare again"
    if os.path.isdir(path) and os.listdir(path):  # raw documents: prepare them into a new directory
        out = os.path.normpath(path) + "-tokens"
        use = f"data.path={out}" if key == "data.path" else f"name {out} in {key}"
        return f"if it holds documents, prepare them: `shardlab prepare {path} --out {out}`, then {use}"
    return f"run `shardlab prepare INPUT... --out {path}` to make one"


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked manifest.json: what training needs to know about a DATA_DIR."""

    path: str                 # the DATA_DIR
    raw: dict[str, Any]
    sha256: str               # of manifest.json's bytes: the corpus identity runs record

    @property
    def vocab_size(self) -> int:
        return int(self.raw["tokenizer"]["vocab_size"])

    @property
    def tokenizer_dir(self) -> str | None:
        """The corpus's copy of its tokenizer; None for bytes (and corpora prepared before the copy)."""
        copy = self.raw["tokenizer"].get("copy")
        return os.path.join(self.path, copy) if copy and os.path.isdir(os.path.join(self.path, copy)) else None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.raw["dtype"]).newbyteorder("<")

    def split(self, name: str) -> dict[str, Any]:
        return self.raw["splits"][name]

    def files(self) -> list[dict[str, Any]]:
        """Every shard file the manifest lists (.bin and .idx), with its bytes and SHA-256."""
        return [f for s in SPLITS for shard in self.split(s)["shards"] for f in (shard["bin"], shard["idx"])]


def read_manifest(path: str, key: str = "data.path") -> Manifest:
    """The manifest of DATA_DIR `path`, checked for format and version; DataError otherwise
    (`key`: the config key the messages name, data.path or data.mix)."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise DataError(f"{key} {path!r}: no such directory; {_prepare_hint(path, key)}")
    if not os.path.isfile(mpath):
        raise DataError(f"{key} {path!r}: no {MANIFEST}, so it is not a prepared corpus (or its prepare was "
                        f"interrupted); {_prepare_hint(path, key)}")
    blob = Path(mpath).read_bytes()
    try:
        raw = json.loads(blob)
    except json.JSONDecodeError as e:
        raise DataError(f"{mpath}: not valid JSON ({e}); prepare the corpus again") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(f"{mpath}: not a shardlab token manifest (format {raw.get('format')!r} is not "
                        f"{FORMAT!r}); {_prepare_hint(path)}")
    if raw.get("version") != FORMAT_VERSION:
        raise DataError(f"{mpath}: format version {raw.get('version')!r}, but this shardlab reads version "
                        f"{FORMAT_VERSION}; prepare the corpus again with this shardlab (`shardlab prepare`)")
    problem = manifest_problem(raw)
    if problem is not None:
        raise DataError(f"{mpath}: {problem}; the manifest was edited or damaged: prepare the corpus again")
    return Manifest(path, raw, hashlib.sha256(blob).hexdigest())


TOKEN_DTYPES = ("uint8", "uint16", "uint32")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def manifest_problem(raw: dict[str, Any]) -> str | None:
    """What is inconsistent in the fields a reader relies on (None: nothing). Each shard's
    `.bin` bytes must be its tokens times the dtype's size and its `.idx` bytes 8 per document,
    so that the size check against the files is a check of the token counts too (a count raised
    by hand would otherwise map past a shard's end)."""
    try:
        dtype, vocab = raw["dtype"], raw["tokenizer"]["vocab_size"]
        if dtype not in TOKEN_DTYPES:
            return f"dtype {dtype!r} is not one of {list(TOKEN_DTYPES)}"
        if not _is_count(vocab) or vocab > 2 ** (8 * np.dtype(dtype).itemsize):
            return f"tokenizer.vocab_size {vocab!r} does not fit dtype {dtype}"
        size = np.dtype(dtype).itemsize
        for split in SPLITS:
            shards = raw["splits"][split]["shards"]
            for shard in shards:
                tokens, docs, names = shard["tokens"], shard["documents"], (shard["bin"]["name"], shard["idx"]["name"])
                if not (_is_count(tokens) and _is_count(docs)):
                    return f"a {split} shard's tokens/documents ({tokens!r}, {docs!r}) are not counts"
                if any(not isinstance(n, str) or os.path.basename(n) != n or n.startswith(".") for n in names):
                    return f"shard file names {list(names)} are not plain names in the directory"
                if shard["bin"]["bytes"] != tokens * size:
                    return (f"{names[0]}: {tokens} tokens of {dtype} make {tokens * size} bytes, but the manifest "
                            f"says {shard['bin']['bytes']}")
                if shard["idx"]["bytes"] != docs * INDEX_DTYPE.itemsize:
                    return f"{names[1]}: {docs} documents make {docs * 8} bytes, but the manifest says {shard['idx']['bytes']}"
            for key in ("tokens", "documents"):
                total = sum(shard[key] for shard in shards)
                if raw["splits"][split][key] != total:
                    return f"splits.{split}.{key} is {raw['splits'][split][key]!r} but its shards hold {total}"
    except (KeyError, TypeError) as e:
        return f"a field a reader needs is missing or malformed ({type(e).__name__}: {e})"
    return None


# -- verification ---------------------------------------------------------------------------------
def _marker_path(m: Manifest) -> Path:
    from shardlab.data.corpus import cache_dir

    key = hashlib.sha256(f"{m.sha256}:{os.path.realpath(m.path)}".encode()).hexdigest()[:32]
    return cache_dir() / "verified-tokens" / f"{key}.json"


def _file_stats(m: Manifest) -> dict[str, list[int]]:
    out = {}
    for f in m.files():
        st = os.stat(os.path.join(m.path, f["name"]))
        out[f["name"]] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def record_verified(m: Manifest) -> None:
    """Remember that these files, as they are now, match the manifest (see [Note: verifying shards])."""
    marker = _marker_path(m)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_file_stats(m)))
    os.replace(tmp, marker)


def verify_data_dir(m: Manifest, full: bool | None = None) -> str:
    """Check the shard files against the manifest: sizes always, SHA-256 when `full` (None:
    when this machine has not verified these files before). Returns "size" or "sha256"."""
    for f in m.files():
        p = os.path.join(m.path, f["name"])
        if not os.path.isfile(p):
            raise DataError(f"{p}: missing, but {MANIFEST} lists it; the corpus is incomplete: prepare it again")
        size = os.path.getsize(p)
        if size != f["bytes"]:
            raise DataError(f"{p}: {size} bytes, but {MANIFEST} says {f['bytes']}; the file was truncated or "
                            "modified: prepare the corpus again")
    marker = _marker_path(m)
    if full is None:
        try:
            full = json.loads(marker.read_text()) != _file_stats(m)
        except (OSError, ValueError):
            full = True
    if not full:
        return "size"
    for f in m.files():
        p = os.path.join(m.path, f["name"])
        if file_sha256(p) != f["sha256"]:
            raise DataError(f"{p}: SHA-256 does not match {MANIFEST}: the file is corrupt or was modified; "
                            "prepare the corpus again (or restore the file)")
    record_verified(m)
    return "sha256"


# -- the memory-mapped stream ---------------------------------------------------------------------
class TokenShards:
    """One split's shards as one read-only token stream. Shards are memory-mapped on first
    use (in whichever process reads: a DataLoader worker maps its own), so no rank copies the
    corpus: every rank on a host shares the page cache's copy.

    [Note: constant RSS] A page of a file mapping that a process has touched counts in its RSS
    (as RssFile) until unmapped, although it is the page cache's, shared and reclaimable. Random
    windows touch pages all over the corpus: measured here, 2000 random 258-byte reads of a
    256 MiB map grew RssFile by 256 MiB, so a long run's RSS would grow to the corpus's size.
    After copying a window out, `read` therefore hands the mapping's pages around it back
    (madvise MADV_DONTNEED: the mapping stays, the page cache keeps the data). The block handed
    back is the 2 MiB-aligned one holding the window, because the kernel maps page-cache folios
    of up to 2 MiB whole: releasing only the window's 4 KiB pages still grew RssFile by 20 MiB
    in 3000 reads of 32 MiB; the 2 MiB block kept it flat (+0.06 MiB), at 24 us a read instead
    of 4 (Linux 6.18, 2026-11-23; a gpt-tiny step is ~100 ms).
    """

    def __init__(self, m: Manifest, split: str):
        shards = [s for s in m.split(split)["shards"] if s["tokens"] > 0]
        self.paths = [os.path.join(m.path, s["bin"]["name"]) for s in shards]
        self.dtype = m.dtype
        self.starts = np.cumsum([0] + [s["tokens"] for s in shards])  # global offset of each shard
        self.num_tokens = int(self.starts[-1])
        self._maps: list[mmap.mmap] | None = None

    def __getstate__(self) -> dict[str, Any]:  # a spawned DataLoader worker maps the files itself
        return {**self.__dict__, "_maps": None}

    def _mapped(self) -> list[mmap.mmap]:
        if self._maps is None:
            self._maps = []
            for p in self.paths:
                with open(p, "rb") as f:
                    self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self._maps

    def _release(self, mm: mmap.mmap, lo: int, hi: int) -> None:
        if _DONTNEED is not None:
            lo = lo // RELEASE_BLOCK * RELEASE_BLOCK
            mm.madvise(_DONTNEED, lo, min(len(mm), -(-hi // RELEASE_BLOCK) * RELEASE_BLOCK) - lo)

    def _spans(self, start: int, count: int):
        """(shard, first token, tokens) of each shard piece that tokens [start, start + count) cover."""
        k, at = int(np.searchsorted(self.starts, start, side="right")) - 1, 0
        while at < count:
            lo = start + at - int(self.starts[k])
            n = min(count - at, int(self.starts[k + 1] - self.starts[k]) - lo)
            yield k, lo, n
            at += n
            k += 1

    def will_need(self, start: int, count: int) -> None:
        """Ask the kernel to read tokens [start, start + count) into the page cache in the
        background (madvise MADV_WILLNEED: asynchronous readahead; maps nothing, costs no RSS)."""
        if _WILLNEED is None:
            return
        maps, size = self._mapped(), self.dtype.itemsize
        for k, lo, n in self._spans(start, count):
            first = lo * size // mmap.PAGESIZE * mmap.PAGESIZE
            maps[k].madvise(_WILLNEED, first, (lo + n) * size - first)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream as int64 (a copy of only those tokens)."""
        maps, out, at, size = self._mapped(), np.empty(count, dtype=np.int64), 0, self.dtype.itemsize
        for k, lo, n in self._spans(start, count):
            out[at:at + n] = np.frombuffer(maps[k], dtype=self.dtype, count=n, offset=lo * size)
            self._release(maps[k], lo * size, (lo + n) * size)
            at += n
        return out
