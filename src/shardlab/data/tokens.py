"""The sources that train on prepared token shards: `data.source=tokens` maps a DATA_DIR
written by `shardlab prepare` (data.path), or several as a weighted mixture (data.mix: the
sampler and the dataset are in mixture.py); `builtin` (the embedded corpus) and `text` (your files) prepare
their inputs into the cache once per machine (keyed by the inputs' content hash, the tokenizer
and data.val_fraction) and map that. No source reads a corpus into memory: a sample is
seq_len + 1 tokens copied out of the map.

`check(cfg)` is their DataSource's `prepare`: it runs before any worker starts (cli) and again
in each worker (under torchrun); it says what to fix when the tokenizer's vocabulary exceeds
the model's, the corpus is empty or shorter than one global batch, or the directory is no
prepared corpus; for a mixture, each corpus, and that they share one tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from shardlab.data.corpus import cache_dir, corpus_jsonl_path, corpus_sha256
from shardlab.data.datasets import Datasets
from shardlab.data.inputs import expand_inputs
from shardlab.data.mixture import (
    MixtureSampler,
    MixtureWindows,
    apportion,
    check_mix_weights,
    normalised_weights,
    source_names,
)
from shardlab.data.prepare import FORMAT_VERSION, input_sha256, prepare
from shardlab.data.shards import (
    MANIFEST,
    DataError,
    Manifest,
    TokenShards,
    file_sha256,
    read_manifest,
    verify_data_dir,
)
from shardlab.data.source import DataSource
from shardlab.data.text import Tokenizer, text_files
from shardlab.errors import ConfigError
from shardlab.models import model_spec


class ShardWindows(torch.utils.data.Dataset):
    """Non-overlapping windows over a split's stream: sample i is (tokens[iT : iT+T],
    tokens[iT+1 : iT+T+1]); a window may cross document and shard boundaries (nanoGPT's)."""

    def __init__(self, stream: TokenShards, seq_len: int, first: int = 0, stop: int | None = None):
        self.stream, self.seq_len = stream, seq_len
        every = max(0, (self.stream.num_tokens - 1) // self.seq_len)
        self.first, self.stop = first, every if stop is None else stop  # the windows [first, stop) of the stream

    def __len__(self) -> int:
        return max(0, self.stop - self.first)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.stream.read((self.first + int(i)) * self.seq_len, self.seq_len + 1))
        return chunk[:-1], chunk[1:]

    def will_need(self, indices: list[int]) -> None:
        """Start reading these samples' pages from storage now (StepBatches: the next step's)."""
        for i in indices:
            self.stream.will_need((self.first + int(i)) * self.seq_len, self.seq_len + 1)


def _split_windows(cfg, m: Manifest) -> tuple[ShardWindows, ShardWindows | None, str]:
    """Train and validation windows, and what validation is (said once by rank 0). A corpus
    prepared without a split has none, unless data.val_from_train holds out the last
    data.val_fraction of its train windows."""
    d, T = cfg.data, cfg.data.seq_len
    train = ShardWindows(TokenShards(m, "train"), T)
    val = ShardWindows(TokenShards(m, "val"), T)
    if len(val) > 0:
        return train, val, f"the corpus's val split ({len(val)} windows, --val-fraction {m.raw.get('val_fraction')})"
    held = int(len(train) * d.val_fraction)
    if d.val_from_train and held > 0:
        return (ShardWindows(train.stream, T, 0, len(train) - held), ShardWindows(train.stream, T, len(train) - held),
                f"the last {held} train windows (data.val_from_train, data.val_fraction={d.val_fraction})")
    return train, None, _no_validation(cfg, m)


def _no_validation(cfg, m: Manifest) -> str:
    """Why a corpus has no validation windows, in terms of what the user did: `shardlab prepare
    --val-fraction` for data.source=tokens; data.val_fraction for builtin/text, which shardlab
    prepared itself (the user ran no prepare, so the line never names one)."""
    d, raw = cfg.data, m.raw
    fraction, held = raw.get("val_fraction"), raw["splits"]["val"]["tokens"]
    hold = "set data.val_from_train=true to hold out the last data.val_fraction of its train windows"
    if d.source == TOKENS.name:
        what, fix = f"{m.path} (prepared with --val-fraction {fraction})", f"prepare it with --val-fraction F, or {hold}"
    else:
        what = f"data.source={d.source}'s corpus (tokenized by shardlab with data.val_fraction={d.val_fraction})"
        fix = "set data.val_fraction above 0" if not fraction else f"{hold}, or give data.path more files"
    if not fraction:
        why = "holds no text out"
    elif held:
        why = f"held out {held} tokens, less than one window of data.seq_len + 1 = {d.seq_len + 1}"
    else:  # prepare holds out whole documents by a hash of their start; a text file is one document
        why = (f"held out none of its {raw['counts']['documents']} document(s) (a document is held out whole, "
               "by a hash of its start, and the first one never)")
    return f"none: {what} has no validation split: it {why}, so no validation loss; {fix}"


def _inputs_of(cfg) -> tuple[list[str], str | None, dict[str, Any]]:
    """builtin/text: what to prepare (specs, forced format) and what run_args.json says of it."""
    d = cfg.data
    if d.source == BUILTIN.name:
        path = corpus_jsonl_path()
        return [str(path)], None, {"corpus": "python stdlib docstrings", "corpus_path": str(path),
                                   "corpus_sha256": corpus_sha256(path)}
    return [d.path], "text", {}


def cached_data_dir(cfg, prepare_if_missing: bool = True) -> str:
    """The cache directory that holds data.source=builtin/text prepared (prepared here if missing)."""
    d = cfg.data
    specs, fmt, _ = _inputs_of(cfg)
    inputs = expand_inputs(specs, fmt)
    key = json.dumps([FORMAT_VERSION, Tokenizer(d.tokenizer).identity()["sha256"], d.val_fraction,
                      [(i.format, input_sha256(i) if i.format == "datasets" else file_sha256(i.path))  # a folder: its files
                       for i in inputs]])
    out = str(cache_dir() / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:24])
    if prepare_if_missing and not os.path.isfile(os.path.join(out, MANIFEST)):
        try:
            # wait_if_busy: several processes of one machine may prepare the same cache at once (the
            # local rank 0 of each agent of a job, several runs): the later ones wait for the first
            # and then find its corpus, instead of being refused as a second `shardlab prepare` is
            prepare(specs, out, tokenizer=d.tokenizer, val_fraction=d.val_fraction, force_format=fmt, progress=False,
                    wait_if_busy=True)
        except (OSError, DataError):  # another process put its copy in place first
            if not os.path.isfile(os.path.join(out, MANIFEST)):
                raise
    return out


def data_dir(cfg) -> str:
    return cfg.data.path if cfg.data.source == TOKENS.name else cached_data_dir(cfg)


def fixed_model_vocab(cfg) -> int | None:
    """The model's vocabulary when the config fixes it (model.vocab_size, or a pretrained HF
    model's: `ModelSpec.own_vocab`); None when the model takes the data's."""
    m = cfg.model
    vocab = getattr(m, "vocab_size", None)
    return vocab if vocab is not None else model_spec(m.name).own_vocab(m)


def check_corpus(cfg, path: str, where: str, full_hash: bool | None = None,
                 key: str = "data.path") -> tuple[Manifest, str]:
    """Read and verify one corpus's manifest, and check it fits the model and the batch. Returns
    the manifest and how it was verified ("size"/"sha256"). `where`, `key`: how messages name it."""
    d, t = cfg.data, cfg.train
    m = read_manifest(path, key=key)
    verified = verify_data_dir(m, full_hash)
    model_vocab = fixed_model_vocab(cfg)
    if model_vocab is not None and m.vocab_size > model_vocab:
        raise DataError(f"{where}: the corpus's tokenizer has {m.vocab_size} token ids but the model's vocab_size is "
                        f"{model_vocab}: token ids >= {model_vocab} would index past the embedding. Set "
                        f"model.vocab_size >= {m.vocab_size}, or prepare the corpus with the model's tokenizer")
    train_tokens = m.split("train")["tokens"]
    if train_tokens == 0:
        raise DataError(f"{where}: the corpus is empty (0 training tokens); prepare it from inputs that hold text")
    samples = (train_tokens - 1) // d.seq_len
    if samples < t.global_batch_size:
        raise DataError(f"{where}: {train_tokens} training tokens make {samples} samples of data.seq_len="
                        f"{d.seq_len}, fewer than one global batch (train.global_batch_size={t.global_batch_size}); "
                        "give more text, or lower train.global_batch_size or data.seq_len")
    return m, verified


def _tokenizer_identity(m: Manifest) -> tuple:
    t = m.raw["tokenizer"]
    return t.get("kind"), t.get("sha256"), t.get("vocab_size"), t.get("eod_id")


def check_mixture(cfg, full_hash: bool | None = None) -> list[tuple[Manifest, str]]:
    """data.mix: every corpus checked as data.path is, each named once, all with one tokenizer."""
    seen: dict[str, str] = {}
    checked = []
    for path in cfg.data.mix:
        real = os.path.realpath(path)
        if real in seen:
            raise DataError(f"data.mix names {seen[real]!r} and {path!r}, which are the same corpus; give it once, "
                            "with the sum of the two weights")
        seen[real] = path
        checked.append(check_corpus(cfg, path, f"data.mix[{path}]", full_hash, key="data.mix"))
    first = checked[0][0]
    for m, _ in checked[1:]:
        if _tokenizer_identity(m) != _tokenizer_identity(first):
            a, b = first.raw["tokenizer"], m.raw["tokenizer"]
            raise DataError(f"data.mix: {first.path!r} and {m.path!r} were prepared with different tokenizers "
                            f"({a.get('kind')}, vocab {a.get('vocab_size')}, sha256 {str(a.get('sha256'))[:12]} vs "
                            f"{b.get('kind')}, vocab {b.get('vocab_size')}, sha256 {str(b.get('sha256'))[:12]}), so "
                            "their token ids mean different things; prepare every corpus of a mixture with the same "
                            "--tokenizer")
    return checked


def check(cfg, full_hash: bool | None = None):
    """Prepare (builtin/text, once), read and verify the manifest(s), and check each corpus fits
    the model and the batch: check_corpus's (manifest, how verified), a list of them for data.mix."""
    d = cfg.data
    if d.source == TOKENS.name and d.mix is not None:
        return check_mixture(cfg, full_hash)
    where = f"data.path={d.path}" if d.source == TOKENS.name else f"data.source={d.source}"
    return check_corpus(cfg, data_dir(cfg), where, full_hash)


def _checked_on_every_rank(cfg):
    """Local rank 0 prepares and (if this machine has not yet) hashes; the others then find
    the cache and the verification marker in place and check sizes only."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
        if first:
            result = check(cfg)
        dist.barrier()
        if not first:
            result = check(cfg)
        return result
    return check(cfg)


def build(cfg) -> Datasets:
    if cfg.data.source == TOKENS.name and cfg.data.mix is not None:
        return build_mixture(cfg)
    m, verified = _checked_on_every_rank(cfg)
    T = cfg.data.seq_len
    train, val, validation = _split_windows(cfg, m)
    if int(os.environ.get("RANK", "0")) == 0 and (val is None or cfg.data.val_from_train):
        print(f"data: validation: {validation}", flush=True)
    info = {**_inputs_of(cfg)[2], **_corpus_info(m, verified), "validation": validation}
    return Datasets(train, val, vocab_size=m.vocab_size, tokens_per_sample=T, info=info,
                    manifest_sha256=m.sha256, tokenizer_files=m.tokenizer_dir)


def _corpus_info(m: Manifest, verified: str) -> dict[str, Any]:
    """What run_args.json records of a corpus."""
    raw = m.raw
    return {"data_dir": m.path, "manifest_sha256": m.sha256, "shards_verified_by": verified,
            "tokenizer": raw["tokenizer"], "dtype": raw["dtype"], "train_tokens": raw["splits"]["train"]["tokens"],
            "val_tokens": raw["splits"]["val"]["tokens"], "documents": raw["counts"]["documents"],
            "replaced_invalid_utf8_bytes": raw["counts"]["replaced_invalid_utf8_bytes"]}


def build_mixture(cfg) -> Datasets:
    """data.mix: the corpora's train windows side by side, sampled by MixtureSampler; validation is
    each corpus's own val split (as data.path's), weighted as the mixture: of the train.eval_batches
    global batches evaluated, corpus j gives its apportioned share (fewer if its split is smaller)."""
    checked, d, t = _checked_on_every_rank(cfg), cfg.data, cfg.train
    weights, names, short = normalised_weights(d.mix), list(d.mix), source_names(list(d.mix))
    val_shares = apportion(t.eval_batches * t.global_batch_size, weights)
    trains, vals, val_names, said, infos = [], [], [], [], []
    for (m, verified), name, w, share, short_name in zip(checked, names, weights, val_shares, short):
        train, val, validation = _split_windows(cfg, m)
        trains.append(train)
        if val is not None and share > 0:
            vals.append(ShardWindows(val.stream, d.seq_len, val.first, min(val.stop, val.first + share)))
            val_names.append(short_name)
            said.append(f"{name}: {len(vals[-1])} windows")
        else:
            said.append(f"{name}: {validation if val is None else '0 windows (its weight is too small)'}")
        infos.append({**_corpus_info(m, verified), "weight": float(w), "train_windows": len(train)})
    validation = "each corpus's own, weighted as the mixture (" + "; ".join(said) + ")"
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"data: validation: {validation}", flush=True)
    # the mixture's identity: its corpora, their order and weights decide which data step s reads
    identity = hashlib.sha256(json.dumps([[m.sha256, str(w)] for (m, _), w in zip(checked, weights)]).encode())
    first = checked[0][0]
    info = {"mix": infos, "manifest_sha256": identity.hexdigest(), "tokenizer": first.raw["tokenizer"],
            "validation": validation}
    sizes = [len(p) for p in trains]
    return Datasets(MixtureWindows(trains, short), MixtureWindows(vals, val_names) if vals else None,
                    vocab_size=first.vocab_size, tokens_per_sample=d.seq_len, info=info,
                    manifest_sha256=identity.hexdigest(), tokenizer_files=first.tokenizer_dir,
                    make_sampler=lambda g, seed, shuffle: MixtureSampler(sizes, weights, g, seed, shuffle, names))


# -- the sources (shardlab.data.DATA_SOURCES) --------------------------------------------------------
def _check_text(cfg) -> None:
    d = cfg.data
    if d.path is None:
        raise ConfigError("data.source=text needs data.path (a file, directory or glob of text files)")
    if not text_files(d.path):
        raise ConfigError(f"data.path {d.path!r}: no such file, directory or glob match; point it at existing text files")


def _check_tokens(cfg) -> None:
    d = cfg.data
    if d.path is not None and d.mix is not None:
        raise ConfigError("data.source=tokens takes data.path (one corpus) or data.mix (a weighted mixture), not both; "
                          "remove one of them")
    if d.path is None and d.mix is None:
        raise ConfigError("data.source=tokens needs data.path (a directory written by `shardlab prepare INPUT... "
                          "--out DATA_DIR`) or data.mix ({DATA_DIR: weight, ...})")
    if d.mix is not None:
        check_mix_weights(d.mix)


def _tokenizer_vocab(cfg) -> int:
    """builtin/text: the vocabulary of data.tokenizer (bytes: 256), what their prepare records."""
    return Tokenizer(cfg.data.tokenizer).vocab_size


def _manifest_vocab(cfg) -> int:
    """tokens: the vocabulary the corpus was prepared with, from its manifest (no shard is read;
    a mixture's corpora share one tokenizer)."""
    d = cfg.data
    return read_manifest(d.path if d.mix is None else next(iter(d.mix))).vocab_size


# prepare (check): builtin/text are tokenized into the cache once, shards new to this machine
# hashed once, and the corpus checked against the model and the batch, before the workers start
BUILTIN = DataSource(name="builtin", kind="tokens", build=build, prepare=check, vocab_size=_tokenizer_vocab,
                     prepared=True)
TEXT = DataSource(name="text", kind="tokens", build=build, check=_check_text, prepare=check,
                  vocab_size=_tokenizer_vocab, prepared=True)
TOKENS = DataSource(name="tokens", kind="tokens", build=build, check=_check_tokens, prepare=check,
                    vocab_size=_manifest_vocab, prepared=True)
