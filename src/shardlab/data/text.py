"""Text to token ids: byte-level by default (vocab 256), or a tokenizer loaded from a local
directory (a `tokenizer.json`, or a Hugging Face model directory holding one) through the
`tokenizers` package. Nothing is fetched from a hub.

Documents are separated by an end-of-document token: for bytes, the byte 0xFF, which valid
UTF-8 never contains (invalid input bytes are replaced by U+FFFD before encoding, so in a
prepared stream 255 marks document ends only); for a tokenizer, its eos token
(`tokenizer_config.json`'s `eos_token`, else the first of EOD_NAMES in its vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

BYTES_EOD = 0xFF
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


def text_files(path: str) -> list[str]:
    """data.path as files: a file, every file below a directory (hidden and VCS entries
    skipped, data/formats.py), or a (recursive) glob."""
    from shardlab.data.formats import walk

    return walk(path)[0]


def _eos_from_config(directory: str) -> str | None:
    p = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(p):
        return None
    eos = json.loads(Path(p).read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


#: The files of a tokenizer directory that decide its ids: hashed into a corpus's identity and copied
#: with it (into a prepared DATA_DIR, then into each run that trains on it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Copy a tokenizer directory's files (TOKENIZER_FILES that exist) into dst, each written whole
    and renamed, so a reader never sees half a tokenizer.json."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            tmp = os.path.join(dst, f".{name}.{os.getpid()}.tmp")
            shutil.copyfile(os.path.join(src, name), tmp)
            os.replace(tmp, os.path.join(dst, name))


class Tokenizer:
    """Bytes (vocab 256) unless a local tokenizer directory is given."""

    def __init__(self, directory: str | None = None):
        self._tok = None
        self.directory = directory
        if directory is not None:
            try:  # deferred: an optional package, needed only with a tokenizer directory
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as e:
                raise RuntimeError("a tokenizer directory needs the `tokenizers` package: pip install tokenizers") \
                    from e
            path = os.path.join(directory, "tokenizer.json")
            if os.path.isfile(directory):
                raise ValueError(f"tokenizer {directory!r} is a file; pass the directory that holds it: "
                                 f"{os.path.dirname(directory) or '.'}")
            if not os.path.exists(directory):
                raise ValueError(f"tokenizer {directory!r}: no such directory; a tokenizer is read from a local "
                                 "directory (nothing is fetched from a hub): download it first, e.g. `hf download "
                                 "NAME tokenizer.json tokenizer_config.json --local-dir DIR`, and pass DIR")
            if not os.path.isfile(path):
                raise ValueError(f"tokenizer {directory!r}: no tokenizer.json there (a slow-only tokenizer: save it "
                                 "with transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) first)")
            self._tok = HFTokenizer.from_file(path)

    @property
    def vocab_size(self) -> int:
        return 256 if self._tok is None else self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        if self._tok is None:
            return BYTES_EOD
        for name in (_eos_from_config(self.directory), *EOD_NAMES):
            if name is not None and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        raise ValueError(f"tokenizer {self.directory!r} has no end-of-document token: set eos_token in its "
                         f"tokenizer_config.json, or add one of {list(EOD_NAMES)} to its vocabulary")

    def identity(self) -> dict[str, Any]:
        """What a manifest records: kind, where from, SHA-256 of its files, vocab, eod token."""
        if self._tok is None:
            return {"kind": "bytes", "vocab_size": 256, "eod_id": BYTES_EOD, "eod_token": "byte 0xFF",
                    "sha256": hashlib.sha256(b"shardlab-bytes-v1").hexdigest()}
        h = hashlib.sha256()
        for name in TOKENIZER_FILES:
            p = os.path.join(self.directory, name)
            if os.path.isfile(p):
                h.update(name.encode() + b"\0" + Path(p).read_bytes())
        return {"kind": "tokenizers", "path": os.path.abspath(self.directory), "vocab_size": self.vocab_size,
                "eod_id": self.eod_id, "eod_token": self._tok.id_to_token(self.eod_id), "sha256": h.hexdigest()}

    def encode_batch(self, texts: list[str | None], raws: list[bytes] | None = None) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added): uint8 arrays for bytes, uint32 for
        a tokenizer. raws[i], when not empty, is texts[i] already encoded as UTF-8 (bytes: used
        as is, without a copy; texts[i] may then be None)."""
        if self._tok is None:
            raws = raws or [b""] * len(texts)
            return [np.frombuffer(r or t.encode("utf-8"), dtype=np.uint8) for t, r in zip(texts, raws)]
        texts = [t if t is not None else r.decode("utf-8") for t, r in zip(texts, raws or [b""] * len(texts))]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(self.encode_batch([text])[0].astype(np.int64))

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids)
