"""LoRA through peft for model.name=hf: adding the adapters and their initialisation (which layers
`model.lora.target_modules` may name is checked in models/hf.py, before any worker starts)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from shardlab.models.hf_load import seed_for


def _is_lora_leaf(module_name: str) -> bool:
    return ".lora_" in module_name


def _init_lora_(p: torch.Tensor, name: str, seed: int) -> None:
    """peft's default LoRA init (A: Kaiming uniform, B: zeros), drawn on CPU from (seed, name)."""
    if ".lora_B" in name:
        p.zero_()
        return
    g = torch.Generator().manual_seed(seed_for(seed, name))
    value = torch.empty(p.shape, dtype=torch.float64)
    bound = (1.0 / p.shape[1]) ** 0.5  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    value.uniform_(-bound, bound, generator=g)
    p.copy_(value.to(p.dtype))


def _add_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    try:  # deferred: peft costs 3 s to import and is an optional extra (shardlab[hf])
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("model.lora needs the `peft` package: pip install 'shardlab[hf]'") from e
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora.get("target_modules"), task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft's PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing`
        # (FutureWarning, transformers 5): that one warning of that one call, nothing else
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config)
