"""What `shardlab prepare` reads: inputs (text, JSONL, Parquet, a `datasets` directory), cut
into pieces that a worker reads on its own, each yielding documents as text.

[Note: pieces] A piece is a small part of one input: about PIECE_BYTES of a text or JSONL
file, one Parquet row group, or a range of rows of a `datasets` directory. Pieces are planned
from sizes and metadata alone, so planning reads no text, and they depend only on the inputs:
the same corpus gives the same pieces, hence the same tokens, for any --workers and
--shard-mb. A file's nominal piece boundary b moves to just after the first newline at or
after b (a JSONL record is never cut); in a text file without a newline within CUT_WINDOW of
b it moves back to the start of the UTF-8 character at b. Both pieces that share a boundary
compute the same cut, so they cover the file exactly once.

A text file is one document (a tokenizer sees it in pieces cut after newlines, so no token
spans a cut); a JSONL line, a Parquet row or a `datasets` row is one document (its --field).
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardlab.data.shards import DataError
from shardlab.data.text import text_files

PIECE_BYTES = 1 << 20
CUT_WINDOW = 64 << 10
DATASETS_MARKERS = ("state.json", "dataset_info.json")  # what datasets.save_to_disk writes


@dataclass(frozen=True)
class Input:
    path: str
    format: str   # text | jsonl | parquet | datasets
    bytes: int


def _format_of(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _is_datasets_dir(path: str) -> bool:
    return os.path.isdir(path) and all(os.path.isfile(os.path.join(path, m)) for m in DATASETS_MARKERS)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def expand_inputs(specs: list[str], force_format: str | None = None) -> list[Input]:
    """Files, directories (every file below) and globs, in the order given, each directory's
    and glob's files sorted. force_format: read every file as that format (data.source=text)."""
    out: list[Input] = []
    for spec in specs:
        spec = os.path.expanduser(spec)
        if _is_datasets_dir(spec):
            out.append(Input(spec, "datasets", _dir_bytes(spec)))
            continue
        files = text_files(spec)
        if not files:
            raise DataError(f"input {spec!r}: no such file, directory or glob match")
        out += [Input(f, force_format or _format_of(f), os.path.getsize(f)) for f in files]
    return out


# -- pieces ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    input: int      # index into the inputs
    start: int      # text/jsonl: nominal byte offset; parquet: row group; datasets: first row
    stop: int       # text/jsonl: nominal end offset; parquet: row group + 1; datasets: end row
    bytes: int      # input bytes it stands for (progress, shard sizing)
    first: bool     # holds the start of the input (text: its document's first bytes)
    last: bool      # holds the end of the input (text: where its end-of-document token goes)


def plan_pieces(inputs: list[Input], field: str) -> list[Piece]:
    pieces: list[Piece] = []
    for i, inp in enumerate(inputs):
        if inp.format in ("text", "jsonl"):
            n = max(1, -(-inp.bytes // PIECE_BYTES))
            pieces += [Piece(i, k * PIECE_BYTES, min(inp.bytes, (k + 1) * PIECE_BYTES),
                             min(inp.bytes, (k + 1) * PIECE_BYTES) - k * PIECE_BYTES, k == 0, k == n - 1)
                       for k in range(n)]
        elif inp.format == "parquet":
            meta = _parquet_file(inp.path, field).metadata
            groups = meta.num_row_groups
            pieces += [Piece(i, g, g + 1, meta.row_group(g).total_byte_size, g == 0, g == groups - 1)
                       for g in range(groups)]
        else:
            ds = _load_datasets_dir(inp.path, field)
            rows = len(ds)
            per_row = max(1, inp.bytes // max(1, rows))
            step = max(1, PIECE_BYTES // per_row)
            pieces += [Piece(i, a, min(rows, a + step), (min(rows, a + step) - a) * per_row, a == 0, a + step >= rows)
                       for a in range(0, rows, step)]
    return pieces


def _cut(f, pos: int, size: int, jsonl: bool) -> int:
    """Where a piece boundary nominally at `pos` really is (see [Note: pieces])."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos)
    at = pos
    while True:
        block = f.read(CUT_WINDOW)
        nl = block.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(block)
        if not block:
            return size
        if not jsonl:  # text without a newline nearby: cut at the UTF-8 character boundary at pos
            f.seek(max(0, pos - 3))
            head = f.read(pos - max(0, pos - 3) + 1)
            back = 0
            while back < 3 and len(head) > back and (head[len(head) - 1 - back] & 0xC0) == 0x80:
                back += 1
            return pos - back


class ReplacementCounter:
    """Decodes UTF-8, replacing each undecodable byte run with U+FFFD, and counts the bytes replaced."""

    NAME = "shardlab-count-replace"
    _current: ReplacementCounter | None = None

    def __init__(self) -> None:
        self.count = 0

    @staticmethod
    def _handle(err: UnicodeDecodeError) -> tuple[str, int]:
        ReplacementCounter._current.count += err.end - err.start
        return "\ufffd", err.end

    def decode(self, raw: bytes) -> str:
        ReplacementCounter._current = self
        return raw.decode("utf-8", errors=self.NAME)


codecs.register_error(ReplacementCounter.NAME, ReplacementCounter._handle)


# -- reading documents ----------------------------------------------------------------------------
def read_piece(inp: Input, piece: Piece, field: str, counter: ReplacementCounter) -> Iterator[tuple[str, bytes]]:
    """The piece's documents (or, for text, its one document part) as (text, raw UTF-8 bytes
    when the text decoded without replacement, else b""). text is None for ASCII bytes, which
    need no decoding to be valid UTF-8 (a byte-level prepare then never builds the string)."""
    if inp.format in ("text", "jsonl"):
        with open(inp.path, "rb") as f:
            a = _cut(f, piece.start, inp.bytes, inp.format == "jsonl")
            b = _cut(f, piece.stop, inp.bytes, inp.format == "jsonl")
            f.seek(a)
            raw = f.read(max(0, b - a))
        if inp.format == "text":
            if raw and raw.isascii():
                yield None, raw
                return
            before = counter.count
            text = counter.decode(raw)
            yield text, raw if counter.count == before else b""
            return
        yield from _jsonl_documents(inp.path, a, raw, field, counter)
    elif inp.format == "parquet":
        pf = _parquet_file(inp.path, field)
        for batch in pf.iter_batches(batch_size=1024, row_groups=[piece.start], columns=[field]):
            for text in batch.column(0).to_pylist():
                yield _as_text(text, inp.path, field), b""
    else:
        ds = _load_datasets_dir(inp.path, field)
        for text in ds[piece.start:piece.stop][field]:
            yield _as_text(text, inp.path, field), b""


def _as_text(value: Any, path: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{path}: field {field!r} holds {type(value).__name__}, not text; pass --field NAME of a "
                        "text column")
    return value


def _jsonl_documents(path: str, offset: int, raw: bytes, field: str, counter: ReplacementCounter):
    at = offset
    for line in raw.split(b"\n"):
        where, at = at, at + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(counter.decode(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: byte {where}: not a JSON line ({e.msg}); JSONL needs one JSON object per "
                            "line") from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}: byte {where}: no field {field!r} in the record (it has {keys}); pass "
                            "--field NAME")
        yield _as_text(record[field], path, field), b""


_OPENED: dict[str, Any] = {}  # per process: a worker opens each Parquet file / datasets dir once


def _parquet_file(path: str, field: str):
    if path not in _OPENED:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: Parquet input needs pyarrow: pip install 'shardlab[data]'") from None
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names[:8]}); pass --field NAME")
        _OPENED[path] = pf
    return _OPENED[path]


def _load_datasets_dir(path: str, field: str):
    if path not in _OPENED:
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: a `datasets` directory needs the datasets package: pip install datasets") \
                from None
        ds = datasets.load_from_disk(path)  # memory-maps its Arrow files
        if not isinstance(ds, datasets.Dataset):
            raise DataError(f"{path}: a DatasetDict ({list(ds)}); give one split's directory, e.g. {path}/train")
        if field not in ds.column_names:
            raise DataError(f"{path}: no column {field!r} (columns: {ds.column_names[:8]}); pass --field NAME")
        _OPENED[path] = ds
    return _OPENED[path]
