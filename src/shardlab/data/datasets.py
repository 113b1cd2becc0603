"""What a data source builds: the train and validation datasets and what the model and the
loop need to know about them. Its own module so a source (data/sft.py) can return one without
importing the registry (data/__init__.py) that imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Datasets:
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset | None
    vocab_size: int | None = None       # text sources
    tokens_per_sample: int | None = None
    info: dict[str, Any] | None = None  # goes to run_args.json (e.g. corpus hash)
    tokenizer_dir: str | None = None    # sft: the tokenizer used (exports copy it)
    # prepared token corpora with a tokenizer (not bytes): its files, copied into each run's
    # <run dir>/tokenizer, where `generate` and exports find them
    tokenizer_files: str | None = None
    # sft: non-padding tokens of each training sample (tokens_processed counts these, not padding)
    real_tokens: torch.Tensor | None = None
    # what happened to the data (examples read, dropped, truncated, rows, target tokens, warnings):
    # rank 0 prints these lines at the start of a run
    report: list[str] = field(default_factory=list)
    # prepared sources (DataSource.prepared): the SHA-256 of the corpus's manifest.json (a resume
    # refuses another)
    manifest_sha256: str | None = None
    # a source whose samples are not drawn uniformly (a mixture of corpora, data/mixture.py):
    # (global_batch_size, seed, shuffle) -> its step-indexed sampler; None: GlobalBatchSampler
    make_sampler: Callable[[int, int, bool], Any] | None = None
