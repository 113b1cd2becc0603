"""LoRA through peft for model.name=hf: adding the adapters and their initialisation (which layers
`model.lora.target_modules` may name is checked in models/hf_checks.py, before any worker starts).

`model.lora.target_modules: null` means peft's default targets for the architecture where peft has
them (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: llama, mistral, mixtral, ...), and the
attention's Linear layers where it has none (qwen2_moe, qwen3_moe, olmoe, deepseek_v3, ...:
`attention_targets`), which in a mixture of experts leaves the fused experts alone: `default_targets`."""

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


def attention_targets(model: nn.Module) -> list[str]:
    """The last names of the Linear (and GPT-2's Conv1D) layers inside the attention blocks (a module
    whose name holds "attn" or "attention"), keeping only names no layer outside them has, so
    that peft's suffix match reaches the attention alone."""
    from transformers.pytorch_utils import Conv1D

    inside: set[str] = set()
    outside: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, Conv1D)):
            parts = name.split(".")
            in_attention = any("attn" in p or "attention" in p for p in parts[:-1])
            (inside if in_attention else outside).add(parts[-1])
    return sorted(inside - outside)


def default_targets(model: nn.Module) -> list[str]:
    """What `model.lora.target_modules: null` adapts: peft's default for the model's architecture,
    else `attention_targets`. Named here, never left to peft: for a family with a weight conversion
    (mixtral, qwen2_moe, ...) peft 0.21 turns a null target list into an empty one before it reads
    its own default, and then refuses ("No `target_modules` passed")."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    known = defaults.get(getattr(model.config, "model_type", None))
    return sorted(known) if known else attention_targets(model)


def _add_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    try:  # deferred: peft costs 3 s to import and is an optional extra (shardlab[hf])
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("model.lora needs the `peft` package: pip install 'shardlab[hf]'") from e
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora.get("target_modules") or default_targets(model), task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft's PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing`
        # (FutureWarning, transformers 5): that one warning of that one call, nothing else
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config)
