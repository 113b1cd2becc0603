"""What an input file is, decided by its content: compression, format, and whether it is text.

[Note: formats by content] Each file `shardlab prepare` (and data.source=text) is given is
sniffed once, before any work:
- **Compression** from its first bytes (magic numbers), whatever its name: gzip, bzip2, xz
  (the standard library) and zstd (the `zstandard` package, multi-frame files included). A
  compressed file is read as one stream.
- **Format** of the (decompressed) content: Parquet by its `PAR1` magic; then the name without
  its compression suffix: `.jsonl`/`.ndjson` are JSONL; `.json` is a JSON array when its first
  non-blank character is `[`, else JSONL (C4's `.json.gz` are JSONL); anything else is text.
- **Not text**: a file whose first SNIFF_BYTES (decompressed) hold a NUL byte, or more than
  MAX_INVALID_SHARE of bytes that are not valid UTF-8, is not a document. Named on the command
  line it is refused with an error; found under a directory or by a glob it is skipped and
  counted (manifest: counts.skipped_files, with the first few paths and reasons).
- **Hidden and VCS entries** (names starting with a dot, such as `.git`, and `CVS`, `_darcs`)
  below a directory are not walked; a glob skips them as Python's glob does.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import io
import lzma
import os
import zlib
from dataclasses import dataclass

from shardlab.data.shards import DataError

SNIFF_BYTES = 8192
MAX_INVALID_SHARE = 0.30  # Latin-1 prose is a few %; compressed or random bytes are over half
SKIPPED_DIRS = frozenset({"CVS", "_darcs"})
MAGIC = ((b"\x1f\x8b", "gz"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zst"))
SUFFIXES = {"gz": (".gz", ".gzip"), "bz2": (".bz2",), "xz": (".xz", ".lzma"), "zst": (".zst", ".zstd")}
SUPPORTED = "text, JSONL, JSON arrays and Parquet, optionally compressed with gzip, bzip2, xz or zstd"


@dataclass(frozen=True)
class Sniffed:
    format: str               # text | jsonl | json | parquet
    compression: str | None   # gz | bz2 | xz | zst | None
    not_text: str | None      # why the file is not text (None: it is)
    bytes: int = 0            # its size on disk


def walk(spec: str) -> tuple[list[str], bool]:
    """The files of a spec and whether it named a single file: a file, every file below a
    directory (hidden and VCS entries pruned, see the Note), or a recursive glob; sorted."""
    if os.path.isfile(spec):
        return [spec], True
    if os.path.isdir(spec):
        out = []
        for root, dirs, files in os.walk(spec):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS]
            out += [os.path.join(root, f) for f in files if not f.startswith(".")]
        return sorted(out), False
    return sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)), False


def open_stream(path: str, compression: str | None, raw=None):
    """A binary file object over the decompressed content of `path`. raw: the file, already open
    (data/streams.py passes a reader that hashes the compressed bytes); the caller closes it."""
    if compression is None:
        return raw or open(path, "rb")
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw) if raw else gzip.open(path, "rb")
    if compression == "bz2":
        return bz2.BZ2File(raw or path, "rb")
    if compression == "xz":
        return lzma.LZMAFile(raw or path, "rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: zstd-compressed input needs the zstandard package: pip install "
                        "'shardlab[data]'") from None
    return io.BufferedReader(_ZstdFrames(raw or open(path, "rb"), zstandard, close=raw is None), buffer_size=1 << 20)


class _ZstdFrames(io.RawIOBase):
    """The frames of a zstd file one after another (as pzstd writes them), refusing a file that
    ends inside a frame: zstandard's stream_reader ends there without a word, so an interrupted
    download would be prepared as a shorter corpus (gzip, bzip2 and xz raise EOFError)."""

    def __init__(self, raw, zstandard, close: bool):
        self.raw, self.zstandard, self.close_raw = raw, zstandard, close
        self.frame = None  # the decompressor of the frame being read
        self.out, self.at, self.rest = b"", 0, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.at == len(self.out):
            data = self.rest or self.raw.read(1 << 15)  # small: a chunk's output is held whole
            if not data:
                if self.frame is not None:
                    raise self.zstandard.ZstdError("it ends inside a zstd frame")
                return 0
            self.frame = self.frame or self.zstandard.ZstdDecompressor().decompressobj()
            self.out, self.at, self.rest = self.frame.decompress(data), 0, b""
            if self.frame.eof:  # the next frame, if any, starts in what this one left
                self.frame, self.rest = None, self.frame.unused_data
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        if self.close_raw:
            self.raw.close()
        super().close()


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or truncated file raises (the decompressors' own errors included)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def head(path: str, compression: str | None, n: int) -> bytes:
    """The first n bytes of the decompressed content (fewer when the file is shorter)."""
    try:
        with open_stream(path, compression) as f:
            out = b""
            while len(out) < n and (block := f.read(n - len(out))):
                out += block
            return out
    except DataError:
        raise
    except read_errors() as e:
        raise DataError(f"{path}: cannot decompress it as {compression} ({e}); the file is damaged or "
                        "truncated") from None


def _invalid_utf8_share(sample: bytes) -> float:
    """The share of bytes in `sample` that are not valid UTF-8 (a character cut at the end is valid)."""
    bad = 0

    def count(err: UnicodeDecodeError) -> tuple[str, int]:
        nonlocal bad
        bad += err.end - err.start
        return "", err.end

    codecs.register_error("shardlab-sniff", count)
    codecs.getincrementaldecoder("utf-8")("shardlab-sniff").decode(sample, final=False)
    return bad / max(1, len(sample))


def _strip_compression(name: str, compression: str | None) -> str:
    for suffix in SUFFIXES.get(compression or "", ()):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def sniff(path: str, force_format: str | None = None) -> Sniffed:
    """See [Note: formats by content]; force_format: the format when the file is text (data.source=text)."""
    with open(path, "rb") as f:
        sample = f.read(SNIFF_BYTES)
        size = os.fstat(f.fileno()).st_size
    compression = next((kind for m, kind in MAGIC if sample.startswith(m)), None)
    if compression is None and sample.startswith(b"PAR1"):
        return Sniffed("parquet", None, None, size)
    if compression is not None:
        sample = head(path, compression, SNIFF_BYTES)
    name = _strip_compression(path.lower(), compression)
    fmt = "text"
    if name.endswith(".parquet"):
        return Sniffed("parquet", compression, "named .parquet but has no Parquet magic (PAR1)", size)
    if b"\0" in sample:
        return Sniffed(fmt, compression, "holds NUL bytes (a binary file)", size)
    share = _invalid_utf8_share(sample)
    if share > MAX_INVALID_SHARE:
        return Sniffed(fmt, compression, f"{share:.0%} of its first {len(sample)} bytes are not UTF-8", size)
    if force_format is not None:
        fmt = force_format
    elif name.endswith((".jsonl", ".ndjson")):
        fmt = "jsonl"
    elif name.endswith(".json"):
        fmt = "json" if sample.lstrip()[:1] == b"[" else "jsonl"
    return Sniffed(fmt, compression, None, size)
