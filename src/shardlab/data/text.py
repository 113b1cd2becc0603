"""Text as fixed windows of token ids: byte-level by default (vocab 256), or a tokenizer
loaded from a local directory (tokenizer.json, via the `tokenizers` package) when given.
The sources data.source=builtin (the embedded corpus) and data.source=text (your files)."""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from shardlab.data import corpus
from shardlab.data.datasets import Datasets
from shardlab.data.source import DataSource
from shardlab.errors import ConfigError


def text_files(path: str) -> list[str]:
    """data.path as files: a file, every file below a directory, or a (recursive) glob."""
    if os.path.isdir(path):
        return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
    if os.path.isfile(path):
        return [path]
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def read_text_files(path: str) -> str:
    parts = []
    for p in text_files(path):
        with open(p, "rb") as f:
            parts.append(f.read().decode("utf-8", errors="replace"))
    return "\n".join(parts)


class Tokenizer:
    """Bytes (vocab 256) unless a local tokenizer directory is given."""

    def __init__(self, directory: str | None = None):
        self._tok = None
        if directory is not None:
            try:  # deferred: an optional package, needed only with data.tokenizer
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as e:
                raise RuntimeError("data.tokenizer needs the `tokenizers` package: pip install tokenizers") from e
            self._tok = HFTokenizer.from_file(os.path.join(directory, "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return 256 if self._tok is None else self._tok.get_vocab_size()

    def encode(self, text: str) -> torch.Tensor:
        if self._tok is None:
            return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
        return torch.tensor(self._tok.encode(text).ids, dtype=torch.int64)

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids)


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows: sample i is (tokens[iT : iT+T], tokens[iT+1 : iT+T+1])."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the text has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                             "give more text or lower data.seq_len")
        self.tokens = tokens.to(torch.int32)  # 4 bytes a token is enough for any vocab here
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def split_tokens(tokens: torch.Tensor, val_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = int(tokens.numel() * val_fraction)
    n_val = max(n_val, seq_len + 1) if val_fraction > 0 else 0
    return tokens[: tokens.numel() - n_val], tokens[tokens.numel() - n_val:]


# -- the sources (shardlab.data.DATA_SOURCES) --------------------------------------------------------
def _build(cfg) -> Datasets:
    d = cfg.data
    tok = Tokenizer(d.tokenizer)
    info: dict[str, Any] = {}
    if d.source == "builtin":
        path = corpus.corpus_path()
        raw = path.read_text(encoding="utf-8")
        info = {"corpus": "python stdlib docstrings", "corpus_path": str(path),
                "corpus_sha256": corpus.corpus_sha256(path), "corpus_bytes": path.stat().st_size}
    else:
        raw = read_text_files(d.path)
    tokens = tok.encode(raw)
    train_t, val_t = split_tokens(tokens, d.val_fraction, d.seq_len)
    info["tokens"] = int(tokens.numel())
    return Datasets(TokenWindows(train_t, d.seq_len),
                    TokenWindows(val_t, d.seq_len) if val_t.numel() > d.seq_len else None,
                    vocab_size=tok.vocab_size, tokens_per_sample=d.seq_len, info=info)


def _check_text(cfg) -> None:
    d = cfg.data
    if d.path is None:
        raise ConfigError("data.source=text needs data.path (a file, directory or glob of text files)")
    if not text_files(d.path):
        raise ConfigError(f"data.path {d.path!r}: no such file, directory or glob match; point it at existing text files")


def _vocab_size(cfg) -> int:
    return Tokenizer(cfg.data.tokenizer).vocab_size


BUILTIN = DataSource(name="builtin", kind="tokens", build=_build, prepare=lambda cfg: corpus.corpus_path(),
                     vocab_size=_vocab_size)
TEXT = DataSource(name="text", kind="tokens", build=_build, check=_check_text, vocab_size=_vocab_size)
