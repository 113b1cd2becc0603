"""`data.source=sft`: supervised fine-tuning examples from local JSON/JSONL, or the embedded
default instruction set, as (inputs, targets) rows with the prompt masked.

Formats (records of JSONL, JSON arrays, Parquet, CSV or `datasets` folders, compressed or not,
a file, folder or glob: data/records.py; detected per record, by its keys, and checked in
data/sft_examples.py):
    alpaca  {"instruction": ..., "input": ... (optional), "output": ...}
    chat    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
    prompt/completion  {"prompt": ..., "completion": ...}: two texts (a user and an assistant
            turn) or two lists of messages (concatenated), as TRL writes them

Prompt template: the tokenizer's chat template when it has one; otherwise DEFAULT_TEMPLATE
(docs/sft.md): "### Instruction:/### Input:/### Response:" for alpaca, "### User:/### Assistant:"
turns for chat, each assistant turn ending in the end-of-text token. The loss is on what the model
must produce: response tokens up to and including that end-of-text token; prompt tokens get target
-100. A chat record must end with an assistant turn (else an error names its line). Rows are
`data.seq_len` tokens: an example longer than that is truncated, and one whose response is cut
away entirely is dropped; rank 0 prints what happened (`report_lines`), with a warning above 5 %.
With `data.packing=true` several examples share a row: inputs are [2, T] (token ids, position
ids restarting at 0 per example; models/hf.py keeps the examples apart: docs/sft.md) and the
padding at the end of a row has target -100 and counts in no token total.

The tokenizer: `data.tokenizer_path` (a local directory with tokenizer.json), else the model's
directory (model.hf_path), which must then have one (pretrained weights need their own
tokenizer), else (a randomly initialized model) a byte-level BPE trained at run time with
`tokenizers` on the examples (cached by content hash). Tokenization is done once per machine
(local rank 0, or `shardlab train` before the workers start), cached by a hash of the data, the
tokenizer files, the chat template and the row settings, and read by the others.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardlab.data.datasets import Datasets
from shardlab.data.loader import require_one_global_batch
from shardlab.data.sft_examples import SFTDataError, builtin_examples, read_with_hash
from shardlab.data.source import DataSource
from shardlab.errors import ConfigError

IGNORE = -100
FORMAT_VERSION = 3  # 2: EOS after every default chat turn, no double BOS, counts in info; 3: chat
# templates tokenized whole, as apply_chat_template does (no BOS the template does not render)
SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
EOS = None  # a piece of `pieces`: the end-of-text token (a token id, not text)
WARN_FRACTION = 0.05  # report_lines warns when more examples than this are dropped or truncated
DEFAULT_TEMPLATE = {
    "alpaca": ("### Instruction:\n{instruction}\n\n", "### Input:\n{input}\n\n", "### Response:\n"),
    "chat_turn": "### {Role}:\n",
}


# -- the tokenizer --------------------------------------------------------------------------------
class SFTTokenizer:
    """Token ids, special tokens and the prompt template; a transformers fast tokenizer inside.

    [Note: the tokenizer as written, and train as you infer]
    A directory's tokenizer.json is loaded as written, through transformers' generic fast tokenizer
    (`PreTrainedTokenizerFast.from_pretrained`: the special tokens and chat template come from
    tokenizer_config.json / chat_template.jinja). `AutoTokenizer` would pick the class that
    config.json's model type names, and some of those classes rebuild the pipeline from the
    vocabulary (Qwen2's replaces a ByteLevel pre-tokenizer with its own split and NFC), so the
    ids would not be the ones the user's tokenizer.json gives. The run's copy and the export are
    saved from this same object, so `AutoTokenizer` on them loads the generic class again.

    With a chat template, an example's ids are exactly `apply_chat_template(messages,
    tokenize=True)`'s: the conversation is rendered once and tokenized whole without added special
    tokens (as transformers does), a BOS only where the template renders one, and the labels
    come from the characters each token covers (prompt or response). Without a chat template,
    shardlab's DEFAULT_TEMPLATE is used, with the tokenizer's BOS first.
    """

    def __init__(self, directory: str, trained: bool = False):
        from transformers import PreTrainedTokenizerFast

        self.directory = directory
        self.trained = trained
        configured = any(os.path.isfile(os.path.join(directory, f))
                         for f in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"))
        if configured:
            self.tok = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        else:
            self.tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"),
                                               pad_token=SPECIALS["pad"], bos_token=SPECIALS["bos"],
                                               eos_token=SPECIALS["eos"])
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.eos_id or 0)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def describe(self) -> str:
        """One line: which tokenizer the rows are made with (the run prints it)."""
        template = "its chat template (BOS only where it renders one)" if self.has_chat_template else \
            "shardlab's default template, BOS first"
        return f"tokenizer: {self.directory}/tokenizer.json as written ({self.vocab_size} tokens), {template}"

    def sha256(self) -> str:
        """What the rows depend on: the tokenizer files and the chat template as loaded (from
        tokenizer_config.json or chat_template.jinja; none: the default template's version)."""
        h = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            p = os.path.join(self.directory, name)
            if os.path.isfile(p):
                h.update(Path(p).read_bytes())
        h.update(json.dumps(getattr(self.tok, "chat_template", None) or "default").encode())
        return h.hexdigest()

    def save(self, out_dir: str) -> None:
        self.tok.save_pretrained(out_dir)

    # -- the conversation as text, with the characters to train on ----------------------------
    def messages(self, ex: dict[str, Any]) -> list[dict[str, str]] | None:
        return ex.get("messages") or _alpaca_as_messages(ex)

    def rendered(self, ex: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation rendered by the chat template, and the [start, end) characters of each
        assistant turn (what the template adds for it, its end-of-turn tokens included)."""
        msgs, spans, done = self.messages(ex), [], ""
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = self.tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            full = self.tok.apply_chat_template(msgs[:i + 1], tokenize=False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise SFTDataError("the tokenizer's chat template does not render turns as prefixes of the "
                                   "conversation; use a tokenizer without a chat template (the default template)")
            spans.append((len(prompt), len(full)))
            done = full
        return done, spans

    def pieces(self, ex: dict[str, Any]) -> list[tuple[str, bool]]:
        """DEFAULT_TEMPLATE's prompt/response pieces: [(text, is_response)], EOS for the end-of-text token."""
        msgs = ex.get("messages")
        if msgs is None:
            a = DEFAULT_TEMPLATE["alpaca"]
            prompt = a[0].format(instruction=ex["instruction"]) + (a[1].format(input=ex["input"]) if ex["input"] else "")
            return [(prompt + a[2], False), (ex["output"], True), (EOS, True)]
        out = []
        for m in msgs:  # an assistant turn ends in the end-of-text token: the model learns to stop
            head = DEFAULT_TEMPLATE["chat_turn"].format(Role=m["role"].capitalize())
            if m["role"] == "assistant":
                out += [(head, False), (m["content"], True), (EOS, True)]
            else:
                out.append((head + m["content"] + "\n\n", False))
        return out

    def encode_example(self, ex: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Token ids and their labels (-100 on prompt tokens): see [Note: the tokenizer as written,
        and train as you infer]."""
        if self.has_chat_template:
            text, spans = self.rendered(ex)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            # a token is trained when it covers a character of a response (one that straddles the
            # prompt's last character and the answer's first carries the answer)
            trained = [any(start < b and end > a for a, b in spans) for start, end in enc["offset_mapping"]]
            return ids, [t if keep else IGNORE for t, keep in zip(ids, trained)]
        ids: list[int] = []
        labels: list[int] = []
        for text, is_response in self.pieces(ex):
            t = self.encode(text) if text is not EOS else [self.eos_id] if self.eos_id is not None else []
            ids += t
            labels += t if is_response else [IGNORE] * len(t)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids, labels = [self.bos_id, *ids], [IGNORE, *labels]
        return ids, labels

    def prompt_ids(self, instruction: str) -> list[int]:
        """What a model fine-tuned on this template reads before its answer to `instruction`
        (`shardlab generate --chat`): with a chat template, `apply_chat_template` of the one user
        turn with the generation prompt, as plain transformers builds it; else the ids of a one-turn
        example up to its first trained token."""
        if self.has_chat_template:
            out = self.tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=True,
                                               add_generation_prompt=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        ids, labels = self.encode_example({"instruction": instruction, "input": "", "output": "."})
        return ids[:next(i for i, label in enumerate(labels) if label != IGNORE)]


def _alpaca_as_messages(ex: dict[str, Any]) -> list[dict[str, str]] | None:
    if "instruction" not in ex:
        return None
    user = ex["instruction"] + (f"\n\n{ex['input']}" if ex["input"] else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": ex["output"]}]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> None:
    """A byte-level BPE trained on `texts` with `tokenizers` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))


# -- preparation (once) and the datasets ----------------------------------------------------------
@dataclass
class Prepared:
    rows_x: torch.Tensor      # [N, T] or [N, 2, T]
    rows_y: torch.Tensor      # [N, T]
    real_tokens: torch.Tensor  # [N] non-padding tokens per row
    info: dict[str, Any]
    tokenizer_dir: str


def _examples(cfg) -> tuple[list[dict[str, Any]], str, str]:
    if cfg.data.path:
        return *read_with_hash(cfg.data.path), cfg.data.path
    ex = builtin_examples()
    return ex, hashlib.sha256(json.dumps(ex).encode()).hexdigest(), "builtin (python stdlib docstrings)"


def _model_vocab(cfg) -> int | None:
    if cfg.model.name == "hf":
        from shardlab.models.hf import hf_vocab_size

        return hf_vocab_size(cfg.model)
    return getattr(cfg.model, "vocab_size", None)


def _hf_path(cfg) -> str | None:
    return getattr(cfg.model, "hf_path", None) if cfg.model.name == "hf" else None


def tokenizer_problem(cfg) -> str | None:
    """Pretrained weights need the tokenizer they were trained with: a BPE trained here would
    give token ids that mean nothing to the weights. None: fine."""
    hf_path = _hf_path(cfg)
    if cfg.data.tokenizer_path or not hf_path or os.path.isfile(os.path.join(hf_path, "tokenizer.json")):
        return None
    return (f"model.hf_path {hf_path!r} holds pretrained weights but no tokenizer.json: a tokenizer trained here "
            "would not match them. Copy the model's tokenizer files into that directory, or give "
            "data.tokenizer_path=<directory with the model's tokenizer.json>")


def tokenizer_dir(cfg, examples: list[dict[str, Any]], data_hash: str) -> tuple[str, bool]:
    d = cfg.data
    if d.tokenizer_path:
        return d.tokenizer_path, False
    problem = tokenizer_problem(cfg)
    if problem:
        raise SFTDataError(problem)
    hf_path = _hf_path(cfg)
    if hf_path:
        return hf_path, False
    from shardlab.data.corpus import cache_dir

    vocab = min(2048, _model_vocab(cfg) or 2048)
    out = cache_dir() / f"sft-tokenizer-{data_hash[:16]}-{vocab}"
    if not (out / "tokenizer.json").exists():
        texts = [" ".join([e.get("instruction", ""), e.get("input", ""), e.get("output", "")] +
                          [m["content"] for m in e.get("messages", [])]) for e in examples]
        tmp = tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".tok-")
        train_tokenizer(texts, vocab, tmp)
        os.makedirs(out.parent, exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process got there first
            pass
    return str(out), True


def check_vocab(cfg, tok: SFTTokenizer) -> None:
    """Pretrained weights (model.hf_path) have a fixed embedding: a tokenizer with more tokens
    would index past it. (A randomly initialized model is built with room for the tokenizer.)"""
    hf_path, model_vocab = _hf_path(cfg), _model_vocab(cfg)
    if hf_path and model_vocab is not None and tok.vocab_size > model_vocab:
        raise SFTDataError(f"the tokenizer in {tok.directory} has {tok.vocab_size} tokens, but the model in "
                           f"model.hf_path {hf_path!r} has {model_vocab} (config.json vocab_size): ids from "
                           f"{model_vocab} up would index past its embedding. Use the tokenizer the model was "
                           "trained with (the one in model.hf_path, or data.tokenizer_path)")


def cache_path(cfg) -> tuple[Path, list[dict[str, Any]], str, str]:
    """The cache file of this data config, the examples, their source and the tokenizer directory.
    The key covers what the rows depend on: data, tokenizer files, chat template, row settings."""
    from shardlab.data.corpus import cache_dir

    examples, data_hash, source = _examples(cfg)
    tdir, trained = tokenizer_dir(cfg, examples, data_hash)
    tok = SFTTokenizer(tdir, trained)
    check_vocab(cfg, tok)
    key = json.dumps([FORMAT_VERSION, data_hash, tok.sha256(), cfg.data.seq_len, cfg.data.packing,
                      cfg.data.val_fraction])
    return cache_dir() / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt", examples, source, tdir


def prepare(cfg) -> tuple[Path, str]:
    """Tokenize, mask, truncate, pack and cache; returns the cache file (reused when present) and
    the tokenizer directory of this config (not the cache's: two directories may share rows)."""
    path, examples, source, tdir = cache_path(cfg)
    if path.exists():
        return path, tdir
    tok = SFTTokenizer(tdir)
    T = cfg.data.seq_len
    chunks, dropped, truncated, longest = [], 0, 0, 0
    for ex in examples:
        ids, labels = tok.encode_example(ex)
        longest = max(longest, len(ids))
        cut = len(ids) > T + 1
        ids, labels = ids[:T + 1], labels[:T + 1]
        x, y = ids[:-1], labels[1:]
        if all(v == IGNORE for v in y):
            dropped += 1  # the response was cut away entirely
            continue
        truncated += cut
        chunks.append((x, y))
    if not chunks:
        raise SFTDataError(f"{source}: every example's response lies beyond data.seq_len={T} tokens (the longest "
                           f"example has {longest}); raise data.seq_len")
    n_val = int(len(chunks) * cfg.data.val_fraction)
    split = {"train": chunks[:len(chunks) - n_val], "val": chunks[len(chunks) - n_val:]}
    out = {name: _rows(part, T, tok.pad_id, cfg.data.packing) for name, part in split.items()}
    info = {"sft_source": source, "examples": len(examples), "dropped_no_response_after_truncation": dropped,
            "truncated": truncated, "longest_example_tokens": longest, "seq_len": T, "tokenizer": tdir,
            "tokenizer_used": tok.describe(), "packing": cfg.data.packing}
    for name, (_, y, _) in out.items():
        info[f"{name}_rows"] = int(y.shape[0])
        info[f"{name}_target_tokens"] = int((y != IGNORE).sum())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="tmp-sft-", suffix=".pt")
    os.close(fd)
    torch.save({"train": out["train"], "val": out["val"], "info": info}, tmp)
    os.replace(tmp, path)
    return path, tdir


def report_lines(info: dict[str, Any]) -> list[str]:
    """What happened to the examples, for rank 0 to print at the start of a run."""
    n, dropped, cut = info["examples"], info["dropped_no_response_after_truncation"], info["truncated"]
    lines = [f"data: {n} examples from {info['sft_source']}: {dropped} dropped, {cut} truncated at "
             f"data.seq_len={info['seq_len']}; {info['train_rows']} train rows ({info['train_target_tokens']} "
             f"target tokens), {info['val_rows']} validation rows ({info['val_target_tokens']} target tokens)"
             + (", packed" if info["packing"] else "")]
    if dropped > WARN_FRACTION * n or cut > WARN_FRACTION * n:
        lines.append(f"warning: {dropped / n:.0%} of the examples were dropped (their response lies beyond "
                     f"data.seq_len) and {cut / n:.0%} truncated; the longest has {info['longest_example_tokens']} "
                     "tokens: raise data.seq_len to keep them whole")
    if info["val_rows"] == 0:
        lines.append("warning: no validation rows (data.val_fraction of the examples rounds to 0): no "
                     "validation loss; raise data.val_fraction")
    if "tokenizer_used" in info:
        lines.append(info["tokenizer_used"])
    return lines


def _rows(chunks: list[tuple[list[int], list[int]]], T: int, pad: int, packing: bool):
    rows: list[list[tuple[list[int], list[int]]]] = []
    for c in chunks:
        if packing and rows and sum(len(x) for x, _ in rows[-1]) + len(c[0]) <= T:
            rows[-1].append(c)
        else:
            rows.append([c])
    n = len(rows)
    X = torch.full((n, T), pad, dtype=torch.int32)
    P = torch.zeros((n, T), dtype=torch.int32)
    Y = torch.full((n, T), IGNORE, dtype=torch.int32)
    real = torch.zeros(n, dtype=torch.int64)
    for i, row in enumerate(rows):
        at = 0
        for x, y in row:
            X[i, at:at + len(x)] = torch.tensor(x, dtype=torch.int32)
            Y[i, at:at + len(y)] = torch.tensor(y, dtype=torch.int32)
            P[i, at:at + len(x)] = torch.arange(len(x), dtype=torch.int32)
            at += len(x)
        real[i] = at
        P[i, at:] = torch.arange(T - at, dtype=torch.int32)  # padding: a segment of its own
    return (torch.stack([X, P], dim=1) if packing else X), Y, real


class SFTRows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, real: torch.Tensor):
        self.x, self.y, self.real = x, y, real

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i].long(), self.y[i].long()


def build(cfg):
    """The Datasets of data.source=sft; local rank 0 prepares the cache, the others wait and read it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
            prepare(cfg)
        dist.barrier()
    path, tdir = prepare(cfg)  # after the barrier: present, only the hash inputs are read
    blob = torch.load(path, weights_only=True)
    tok = SFTTokenizer(tdir)
    train = SFTRows(*blob["train"])
    val = SFTRows(*blob["val"]) if blob["val"][0].shape[0] else None
    info = {**blob["info"], "tokenizer": tdir, "cache": str(path)}
    return Datasets(train, val, vocab_size=tok.vocab_size, tokens_per_sample=None, info=info,
                    tokenizer_dir=tdir, real_tokens=train.real, report=report_lines(info))


# -- the source (shardlab.data.DATA_SOURCES) ---------------------------------------------------------
def _check(cfg) -> None:
    """data.source=sft: the data file exists; pretrained weights come with their tokenizer."""
    d = cfg.data
    if d.path is not None and not os.path.exists(os.path.expanduser(d.path)) and not glob.glob(d.path, recursive=True):
        raise ConfigError(f"data.path {d.path!r}: no such file, folder or glob match; give JSONL, JSON, Parquet, CSV "
                          "or a datasets folder of alpaca or chat records (or null for the embedded instruction set)")
    problem = tokenizer_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)


def _prepare_and_check(cfg) -> tuple[Path, str]:
    """prepare, then the check that needs the rows: one global batch of them at least."""
    path, tdir = prepare(cfg)
    info = torch.load(path, weights_only=True, mmap=True)["info"]  # mmap: the rows stay on disk
    unpack = ", set data.packing=false (packing puts several examples in a row)," if cfg.data.packing else ""
    require_one_global_batch(info["train_rows"], cfg.train.global_batch_size,
                             f"data.source=sft ({info['sft_source']})",
                             f"give more examples{unpack} or lower train.global_batch_size")
    return path, tdir


# prepare: read, check (errors name file and line), tokenize and cache once, before the workers
SOURCE = DataSource(name="sft", kind="tokens", build=build, check=_check, prepare=_prepare_and_check, packing=True)
