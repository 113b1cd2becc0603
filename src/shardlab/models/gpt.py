"""A GPT-style decoder, nanoGPT-like: pre-LayerNorm blocks, causal self-attention,
GELU MLP, learned positions, and a head whose weight is tied to the token embedding."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.errors import ConfigError
from shardlab.models.init import INIT_STD_ATTR, init_parameters_
from shardlab.models.lm_loss import choose_loss, chunked_loss, full_loss
from shardlab.models.spec import ModelSpec


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


# Presets, from a test-sized toy to GPT-2 small and medium. vocab 256 = byte-level text.
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-nano": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64),          # ~0.04M
    "gpt-tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),        # ~0.8M
    "gpt-mini": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),        # ~10.8M
    "gpt-small": GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=256),       # ~25M
    "gpt2-small": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024),   # 124M
    "gpt2-medium": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        setattr(self.proj, INIT_STD_ATTR, 0.02 / (2 * cfg.n_layer) ** 0.5)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        setattr(self.proj, INIT_STD_ATTR, 0.02 / (2 * cfg.n_layer) ** 0.5)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx, targets=None) -> logits, or the mean cross-entropy loss when targets are given
    (whole or chunked: `use_loss`, models/lm_loss.py)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.init_seed = seed
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.loss = "full"  # what use_loss chose (train.loss); a model built outside training keeps the full loss
        if self.tok_emb.weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.loss == "chunked":
            return chunked_loss(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        return logits if targets is None else full_loss(logits, targets)

    def use_loss(self, requested: str) -> str | None:
        """train.loss (auto | chunked | full) -> the loss forward computes; a line to print, or None."""
        self.loss, note = choose_loss(requested, self.config.vocab_size, self.config.n_embd, None)
        return note

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


# -- registry entry (shardlab.models.MODELS) -------------------------------------------------------
@dataclass
class GPTKeys:
    """`model.*` keys of model.name=gpt: a preset and per-field overrides of it."""

    preset: str = "gpt-tiny"               # a key of GPT_PRESETS
    n_layer: Optional[int] = None          # overrides of the preset (null = the preset's)
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None
    vocab_size: Optional[int] = None       # null: from the data (256 for byte-level text)
    dropout: float = 0.0


def gpt_config(section, vocab_size: int | None = None) -> GPTConfig:
    """The preset with the section's overrides; vocab from the section, else the data's, else the preset's."""
    base = GPT_PRESETS[section.preset]
    overrides = {k: getattr(section, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
    fields = {k: v for k, v in overrides.items() if v is not None}
    vocab = section.vocab_size or vocab_size or base.vocab_size
    return GPTConfig(**{**asdict(base), **fields, "vocab_size": vocab, "dropout": section.dropout})


def _check(section) -> None:
    if section.preset not in GPT_PRESETS:
        raise ConfigError(f"model.preset: unknown value {section.preset!r}; valid: {', '.join(GPT_PRESETS)}")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        v = getattr(section, k)
        if v is not None and v < 1:
            raise ConfigError(f"model.{k} must be >= 1 (or null for the preset's), got {v}")
    cfg = gpt_config(section)
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})")
    if not 0.0 <= section.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {section.dropout}")


SPEC = ModelSpec(
    name="gpt", keys=GPTKeys, data_kind="tokens",
    build=lambda section, seed, vocab: GPT(gpt_config(section, vocab), seed=seed),
    record=lambda model: asdict(model.config),
    rebuild=lambda kwargs, seed: GPT(GPTConfig(**kwargs), seed=seed),
    check=_check,
    synthetic=lambda section: {"vocab_size": section.vocab_size or 256},
    max_seq_len=lambda section: gpt_config(section).block_size,
    depth=lambda section: gpt_config(section).n_layer,
    loss_head=True,
    cut_depth=lambda raw, n_layer, tmpdir: raw.update(n_layer=n_layer),
    vocab_key="vocab_size")
