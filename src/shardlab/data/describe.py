"""`shardlab data inspect DATA_DIR [--docs N] [--split S]`: what a prepared corpus holds, from
its manifest (documents, tokens, shards, dtype, tokenizer, split, what prepare skipped), and its
first N documents decoded with the corpus's own tokenizer (its copy in DATA_DIR; bytes for a
byte corpus). Reads the manifest and as many tokens as those documents need, nothing else."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from shardlab.data.shards import DataError, TokenShards, read_manifest
from shardlab.data.text import Tokenizer


def first_documents(path: str, split: str, n: int, max_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """The token ids of the split's first n documents, each with its end-of-document token (at
    most max_tokens of each), and each document's length in tokens."""
    m = read_manifest(path)
    stream, docs, at = TokenShards(m, split), [], 0
    for shard in m.split(split)["shards"]:
        ends = np.fromfile(os.path.join(path, shard["idx"]["name"]), dtype="<i8")
        for end in ends[: n - len(docs)]:
            start = docs[-1][1] if docs else 0
            docs.append((start, at + int(end)))
        at += shard["tokens"]
        if len(docs) >= n:
            break
    return [(stream.read(a, min(b - a, max_tokens or b - a)).tolist(), b - a) for a, b in docs]


def describe(path: str, split: str = "train", docs: int = 3, chars: int = 400) -> str:
    m = read_manifest(path)
    raw, c = m.raw, m.raw["counts"]
    tok = raw["tokenizer"]
    lines = [f"{path}: {raw['format']} v{raw['version']}, dtype {raw['dtype']}, tokenizer {tok['kind']} "
             f"(vocab {tok['vocab_size']}, end of document {tok['eod_token']!r} = {tok['eod_id']}"
             + (f", from {tok['path']}" if tok.get("path") else "") + ")"]
    for name in ("train", "val"):
        s = m.split(name)
        lines.append(f"  {name}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shard(s)")
    lines.append(f"  inputs: {len(raw.get('inputs', []))} file(s), {c['input_bytes']:,} bytes; --val-fraction "
                 f"{raw.get('val_fraction')}, --field {raw.get('field')!r}")
    for key, what in (("bad_records", "bad records skipped"), ("skipped_files", "files skipped as not text"),
                      ("duplicates", "duplicate documents dropped"),
                      ("replaced_invalid_utf8_bytes", "invalid UTF-8 bytes replaced"),
                      ("byte_order_marks", "UTF-8 byte-order marks dropped")):
        if key in c:
            lines.append(f"  {what}: {c[key]:,}")
            lines += [f"    {where}" for where in c.get(f"{key}_first", [])]
    decoder = Tokenizer(m.tokenizer_dir) if m.tokenizer_dir else Tokenizer(None)
    for k, (ids, length) in enumerate(first_documents(path, split, docs, 4 * chars)):  # a char: up to 4 bytes
        text = decoder.decode(ids[:-1] if len(ids) == length else ids)  # without its end-of-document token
        more = " ..." if len(text) > chars or len(ids) < length else ""
        lines.append(f"--- {split} document {k} ({length:,} tokens) ---\n{text[:chars]}{more}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True)
    ins = sub.add_parser("inspect", help="what a prepared corpus holds, and its first documents decoded",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ins.add_argument("path", metavar="DATA_DIR")
    ins.add_argument("--docs", type=int, default=3, metavar="N", help="documents to decode (default 3)")
    ins.add_argument("--split", choices=("train", "val"), default="train")
    ins.add_argument("--chars", type=int, default=400, metavar="C", help="characters shown per document (default 400)")


def run(args: argparse.Namespace) -> int:
    try:
        print(describe(args.path, args.split, args.docs, args.chars))
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
