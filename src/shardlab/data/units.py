"""How `shardlab prepare` cuts a corpus into units, one worker task and one training shard each
(data/prepare.py runs them): consecutive pieces (data/inputs.py) up to a unit's worth of input
bytes, and a large compressed JSONL file cut while it is decompressed.

[Note: one compressed stream in parallel] A compressed file cannot be entered in the middle,
so read by one worker it is one unit, and a corpus that is one big `.jsonl.zst` was prepared
by one worker whatever --workers said (measured at 2 workers: 0.55x the speed of the same JSONL
uncompressed). A compressed JSONL input larger than a unit is therefore *split*: this process
(prepare's parent) decompresses it once, front to back, and cuts the decompressed bytes into
pieces as an uncompressed file is cut: PIECE_BYTES, then on to the end of the line that holds
the last of them, so no record is cut. Each piece carries its bytes, its decompressed offset and
the number of its first line (messages name the true line). Consecutive pieces make units of a
shard's worth of input (--shard-mb), but at most STREAM_UNIT_BYTES, of decompressed bytes (the
file's decompressed size is not known before it is read, so the sixteenth of the corpus that
bounds other units cannot bound these). They are handed to the worker pool as they are cut:
the pool's task thread asks this generator for the next unit only after its previous one was
written to the workers' pipe, a write that blocks until an idle worker reads it, so about
--workers + 2 units are in memory whatever the file's size. The pieces depend on the file
alone, the units on the file, --shard-mb and these constants: --workers changes neither, so
the output is the same byte for byte (tested against one worker). The file's SHA-256 (as
stored, for the manifest) comes from the compressed bytes as they are read and travels with
the last piece.
A compressed file no larger than a unit stays one piece that a worker decompresses itself, so a
corpus of many compressed files (how The Pile and RedPajama ship) decompresses on every worker;
a corpus of several large ones is decompressed by this one process, one file after the other
(a limit: docs/data.md gives its speed). A compressed text file is one document and a JSON array
one value: neither is split.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlab.data.formats import open_stream, read_errors
from shardlab.data.inputs import PIECE_BYTES, Input, Piece, damaged

MIN_UNITS = 16             # see unit_target
MIN_UNIT_BYTES = 4 << 20
STREAM_UNIT_BYTES = 16 << 20  # a split file's units at most: what a task carries (see the Note)


def group_units(pieces: list[Piece], target_input_bytes: int) -> list[list[Piece]]:
    units: list[list[Piece]] = [[]]
    size = 0
    for p in pieces:
        if units[-1] and size + p.bytes > target_input_bytes:
            units.append([])
            size = 0
        units[-1].append(p)
        size += p.bytes
    return [u for u in units if u]


def unit_target(pieces: list[Piece], shard_input_bytes: int) -> int:
    """Input bytes per unit: a shard's worth, but at most 1/MIN_UNITS of the corpus (not below
    MIN_UNIT_BYTES), so that a corpus of many small files still gives every worker work. It
    depends on the inputs and --shard-mb only, never on --workers."""
    total = sum(p.bytes for p in pieces)
    return max(1, min(shard_input_bytes, max(MIN_UNIT_BYTES, total // MIN_UNITS)))


@dataclass(frozen=True)
class Split:
    """A compressed JSONL input cut as it is decompressed (see the Note), into units of `unit_bytes`."""

    input: int
    unit_bytes: int


def splits(inp: Input, target: int) -> bool:
    return inp.compression is not None and inp.format == "jsonl" and inp.bytes > target


def plan_units(inputs: list[Input], pieces: list[Piece], target: int,
               shard_input_bytes: int) -> list[list[Piece] | Split]:
    """The corpus's units in order: groups of pieces (of `target` input bytes, unit_target's),
    and a Split for each split input."""
    out: list[list[Piece] | Split] = []
    run: list[Piece] = []
    for p in pieces:
        if splits(inputs[p.input], target):
            out += group_units(run, target)
            run = []
            out.append(Split(p.input, max(1, min(shard_input_bytes, STREAM_UNIT_BYTES))))
        else:
            run.append(p)
    return out + group_units(run, target)


def unit_tasks(inputs: list[Input], layout: list[list[Piece] | Split]) -> Iterator[tuple[str, Any]]:
    """The worker tasks, made as they are asked for: ("hash", (index, Input)) for an input cut
    across units (a split one is hashed as it is read), then ("unit", (number, pieces, the
    unit's own inputs)) in corpus order. A task carries only its own inputs."""
    units = [u for u in layout if not isinstance(u, Split)]
    whole = {i for u in units for i in ({p.input for p in u if p.first} & {p.input for p in u if p.last})}
    whole |= {u.input for u in layout if isinstance(u, Split)}
    yield from (("hash", (i, inp)) for i, inp in enumerate(inputs) if i not in whole)
    n = 0
    for u in layout:
        for pieces in stream_units(inputs[u.input], u) if isinstance(u, Split) else [u]:
            yield "unit", (n, pieces, {p.input: inputs[p.input] for p in pieces})
            n += 1


def stream_units(inp: Input, split: Split) -> Iterator[list[Piece]]:
    unit: list[Piece] = []
    size = 0
    for p in stream_pieces(inp, split.input):
        if unit and size + len(p.data) > split.unit_bytes:
            yield unit
            unit, size = [], 0
        unit.append(p)
        size += len(p.data)
    if unit:
        yield unit


class _HashingReader(io.RawIOBase):
    """The compressed file as its decompressor reads it, hashed and counted on the way."""

    def __init__(self, path: str):
        self.f = open(path, "rb")
        self.sha256 = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.sha256.update(memoryview(b)[:n])
        self.count += n
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def stream_pieces(inp: Input, index: int) -> Iterator[Piece]:
    """The pieces of compressed JSONL input `index` (see the Note); `bytes` of each is the
    compressed bytes read for it, so the pieces' sum is the file's size."""
    at, line, counted = 0, 1, 0
    try:
        with _HashingReader(inp.path) as raw, open_stream(inp.path, inp.compression, raw) as f:
            while True:
                data = f.read(PIECE_BYTES)
                if data and not data.endswith(b"\n"):
                    data += f.readline()  # to the end of the line: a record is never cut
                last = not f.peek(1)
                if last:
                    while raw.read(1 << 20):  # what follows the compressed data, if anything: hashed too
                        pass
                yield Piece(index, at, at + len(data), raw.count - counted, at == 0, last, data, line,
                            raw.sha256.hexdigest() if last else None)
                if last:
                    return
                at, counted = at + len(data), raw.count
                line += int(np.count_nonzero(np.frombuffer(data, np.uint8) == 10))  # 5x bytes.count here
    except read_errors() as e:
        raise damaged(inp, e) from None
