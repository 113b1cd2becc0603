"""How `shardlab prepare` cuts a corpus into units, one worker task and one training shard each
(data/prepare.py runs them): consecutive pieces (data/inputs.py) up to a unit's worth of input
bytes, and a large compressed JSONL file cut while it is decompressed.

[Note: one compressed stream in parallel] A compressed file cannot be entered in the middle, so
read by one worker it is one unit, and a corpus that is one big `.jsonl.zst` was prepared by one
worker whatever --workers said (measured at 2 workers: 0.55x the speed of the same JSONL
uncompressed; split as below, 0.82x, a median over runs from 0.74x to 0.91x: docs/data.md). A
compressed JSONL input larger than a unit is therefore *split*: this process (prepare's parent)
decompresses it once, front to back, and cuts the decompressed bytes into pieces as an
uncompressed file is cut (data/inputs.py): at every multiple of PIECE_BYTES, moved on to just
after the first newline at or after it, so no record is cut. Each piece carries its bytes, its
decompressed offset and the number of its first line (messages name the true line). A unit is
the pieces that start in the same window of the stream, a shard's worth of input (--shard-mb)
but at most STREAM_UNIT_BYTES of decompressed bytes (the file's decompressed size is not known
before it is read, so the sixteenth of the corpus that bounds other units cannot bound these).
Units are cut as the workers take them: the pool's task thread asks this generator for the next
unit only after its previous one went into the workers' pipe, a write that blocks until an idle
worker reads it, so about --workers + 2 units are in memory whatever the file's size (measured
in docs/data.md: the parent's peak memory is the same for 256 MiB and 1 GiB of JSONL). The
pieces depend on the file alone, the units on the file, --shard-mb and these constants:
--workers changes neither, so the output is the same byte for byte (tested against one worker).
The file's SHA-256 (as stored, for the manifest) is a task of its own, as for any input cut
across units.
A compressed file no larger than a unit stays one piece that a worker decompresses itself, so a
corpus of many compressed files (how The Pile and RedPajama ship) decompresses on every worker;
a corpus of several large ones is decompressed by this one process, one file after the other
(a limit: docs/data.md gives its speed). A compressed text file is one document and a JSON array
one value: neither is split.
"""

from __future__ import annotations

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
    across units (a split one too), then ("unit", (number, pieces, the
    unit's own inputs)) in corpus order. A task carries only its own inputs."""
    units = [u for u in layout if not isinstance(u, Split)]
    whole = {i for u in units for i in ({p.input for p in u if p.first} & {p.input for p in u if p.last})}
    yield from (("hash", (i, inp)) for i, inp in enumerate(inputs) if i not in whole)
    n = 0
    for u in layout:
        for pieces in stream_units(inputs[u.input], u) if isinstance(u, Split) else [u]:
            yield "unit", (n, pieces, {p.input: inputs[p.input] for p in pieces})
            n += 1


def stream_units(inp: Input, split: Split) -> Iterator[list[Piece]]:
    """The pieces of a split input in units: those that start in the same unit_bytes of the stream."""
    unit: list[Piece] = []
    for p in stream_pieces(inp, split.input):
        if unit and p.start // split.unit_bytes != unit[0].start // split.unit_bytes:
            yield unit
            unit = []
        unit.append(p)
    if unit:
        yield unit


class _CountingReader(io.RawIOBase):
    """The compressed file as its decompressor reads it, counted on the way."""

    def __init__(self, path: str):
        self.f = open(path, "rb")
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
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
        with _CountingReader(inp.path) as raw, open_stream(inp.path, inp.compression, raw) as f:
            while True:  # to the next multiple of PIECE_BYTES, then to the end of its line
                data = f.read((at // PIECE_BYTES + 1) * PIECE_BYTES - at)
                data += f.readline()  # a record is never cut
                last = not f.peek(1)
                yield Piece(index, at, at + len(data), (inp.bytes if last else raw.count) - counted, at == 0, last,
                            data, line)
                if last:
                    return
                at, counted = at + len(data), raw.count
                line += int(np.count_nonzero(np.frombuffer(data, np.uint8) == 10))  # 5x bytes.count here
    except read_errors() as e:
        raise damaged(inp, e) from None
