"""What an input file is, decided by its content: compression, format, and whether it is text.

[Note: formats by content] Each file `shardlab prepare` (and data.source=text) is given is
sniffed once, before any work:
- **Compression** from its first bytes (magic numbers), whatever its name: gzip, bzip2, xz
  (the standard library) and zstd (the `zstandard` package, multi-frame files included). A
  compressed file is read as one stream.
- **Format** of the (decompressed) content: Parquet by its `PAR1` magic; then the name without
  its compression suffix: `.jsonl`/`.ndjson` are JSONL; `.json` is a JSON array when its first
  non-blank character is `[`, else JSONL (C4's `.json.gz` are JSONL); `.csv` and `.tsv` are
  tables (a header row, the text in the --field column: data/tables.py), never one document;
  anything else is text.
- **Byte-order marks**: a UTF-8 BOM (EF BB BF) at the start is not part of the text: the readers
  drop it (data/inputs.py) and count it. A UTF-16 or UTF-32 file (its BOM, or NUL bytes every
  other byte) is not UTF-8: refused with the conversion to run (iconv), skipped in a tree.
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
SUPPORTED = ("text, JSONL, JSON arrays, CSV/TSV with a header row, Parquet and `datasets` save_to_disk folders, "
             "optionally compressed with gzip, bzip2, xz or zstd")
UTF8_BOM = b"\xef\xbb\xbf"
# tables people keep corpora in that prepare does not read, named in the refusal (a binary file else)
KNOWN_BINARY = ((".arrow", "an Arrow file outside a `datasets` save_to_disk folder"), (".feather", "a Feather file"),
                (".orc", "an ORC file"), (".avro", "an Avro file"), (".xlsx", "an Excel workbook"),
                (".xls", "an Excel workbook"), (".pkl", "a pickle"), (".pickle", "a pickle"),
                (".npy", "a NumPy array"), (".h5", "an HDF5 file"), (".hdf5", "an HDF5 file"), (".pdf", "a PDF"))
WIDE_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"),
             (b"\xff\xfe", "UTF-16"))  # UTF-32-LE's BOM begins with UTF-16-LE's: longest first


@dataclass(frozen=True)
class Sniffed:
    format: str               # text | jsonl | json | csv | tsv | parquet
    compression: str | None   # gz | bz2 | xz | zst | None
    not_text: str | None      # why the file is not text (None: it is)
    bytes: int = 0            # its size on disk


def is_datasets_dir(path: str) -> bool:
    """A folder `datasets`' save_to_disk wrote: a Dataset (its state.json and dataset_info.json)
    or a DatasetDict (its dataset_dict.json, a folder per split)."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or \
        all(os.path.isfile(os.path.join(path, m)) for m in ("state.json", "dataset_info.json"))


def walk(spec: str) -> tuple[list[str], bool, list[str]]:
    """The files of a spec, whether it named a single file, and the `datasets` folders in it: a
    file, every file below a directory (hidden and VCS entries pruned, see the Note; a `datasets`
    folder is returned whole, its Arrow files are not files of the corpus), or a recursive glob;
    sorted."""
    if os.path.isfile(spec):
        return [spec], True, []
    if os.path.isdir(spec):
        if is_datasets_dir(spec):
            return [], True, [spec]
        out, found = [], []
        for root, dirs, files in os.walk(spec):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
            for d in [d for d in dirs if is_datasets_dir(os.path.join(root, d))]:
                found.append(os.path.join(root, d))
                dirs.remove(d)
            out += [os.path.join(root, f) for f in files if not f.startswith(".")]
        return sorted(out), False, sorted(found)
    found = []
    for p in sorted(glob.glob(spec, recursive=True)):  # a folder first, then what is in it
        if os.path.isdir(p) and is_datasets_dir(p) and not any(p.startswith(f + os.sep) for f in found):
            found.append(p)
    inside = tuple(f + os.sep for f in found)
    return sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and not p.startswith(inside)), \
        False, found


def open_stream(path: str, compression: str | None, raw=None):
    """A binary file object over the decompressed content of `path`. raw: the file, already open
    (data/units.py passes a reader that counts the compressed bytes); the caller closes it."""
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


def _wide_encoding(sample: bytes) -> str | None:
    """UTF-16/32 by its BOM, or UTF-16 without one (ASCII-range text: a NUL every other byte); as
    iconv names it (with a BOM, iconv's UTF-16 reads the byte order from it and drops it)."""
    for bom, name in WIDE_BOMS:
        if sample.startswith(bom):
            return name
    even, odd = sample[0:64:2], sample[1:64:2]
    if len(sample) < 16:
        return None
    if not odd.strip(b"\0") and _ascii_text(even):
        return "UTF-16LE"
    if not even.strip(b"\0") and _ascii_text(odd):
        return "UTF-16BE"
    return None


def _ascii_text(half: bytes) -> bool:
    return half.isascii() and all(b >= 0x20 or b in b"\t\n\r" for b in half)


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
    wide = _wide_encoding(sample)
    if wide is not None:
        return Sniffed(fmt, compression, f"{wide} text, not UTF-8; convert it first: iconv -f {wide} -t UTF-8 "
                                         "FILE > FILE.utf8", size)
    if b"\0" in sample:
        known = next((what for ext, what in KNOWN_BINARY if name.endswith(ext)), None)
        why = f"{known}, a format prepare does not read: convert it to Parquet or JSONL" if known else \
            "holds NUL bytes (a binary file)"
        return Sniffed(fmt, compression, why, size)
    share = _invalid_utf8_share(sample)
    if share > MAX_INVALID_SHARE:
        return Sniffed(fmt, compression, f"{share:.0%} of its first {len(sample)} bytes are not UTF-8", size)
    if force_format is not None:
        fmt = force_format
    elif name.endswith((".jsonl", ".ndjson")):
        fmt = "jsonl"
    elif name.endswith(".json"):
        fmt = "json" if sample.removeprefix(UTF8_BOM).lstrip()[:1] == b"[" else "jsonl"
    elif name.endswith((".csv", ".tsv")):
        fmt = name[-3:]
    return Sniffed(fmt, compression, None, size)
