"""`model.name=hf`: a Hugging Face `transformers` causal LM (Mistral, Llama, Qwen2, GPT-2, ...)
built from local files only, optionally with LoRA adapters through `peft`.

    model.hf_path     a local directory: config.json and safetensors weights (one file, or
                      sharded with model.safetensors.index.json)
    model.hf_config   a config JSON only: random init with the model's own `_init_weights`
    model.hf_dtype    the parameters' (master weights') dtype: fp32 | bf16 | fp64
    model.hf_attention  transformers' attention implementation (null: its default for the family)
    model.lora.*      rank > 0 adds LoRA adapters; the base weights are frozen

This file is the registry entry (`SPEC`: keys, build, record, rebuild, depth). The module itself,
`HFCausalLM`, and how every construction fills it are in models/hf_model.py ([Note: how an engine
fills a model built on the meta device], [Note: packed sequences]); the checks before any worker
starts in models/hf_checks.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from shardlab.models.hf_checks import (  # noqa: F401  (the checks other code imports from here)
    _meta_build,
    _packing_problem,
    check_hf,
    lora_layer_names,
    lora_parameter_problem,
    lora_target_problem,
)
from shardlab.models.hf_load import SafetensorsReader, weight_files  # noqa: F401  (this module's API too)
from shardlab.models.hf_model import (  # noqa: F401  (HFCausalLM, LoRAKeys: imported from here)
    HF_DTYPES,
    HFCausalLM,
    LoRAKeys,
    build_hf,
    config_file,
    load_hf_config,
    require_transformers,
)
from shardlab.models.spec import ModelSpec


@dataclass
class HFKeys:
    """`model.*` keys of model.name=hf."""

    hf_path: Optional[str] = None          # local HF directory: config.json + safetensors
    hf_config: Optional[str] = None        # a config JSON (or a directory with config.json): random init
    hf_dtype: str = "fp32"                 # parameter dtype: fp32 | bf16 | fp64
    hf_attention: Optional[str] = None     # attention implementation: eager | sdpa | ...; null: transformers' default
    lora: LoRAKeys = field(default_factory=LoRAKeys)


def _record(model: HFCausalLM) -> dict[str, Any]:
    dtype = {v: k for k, v in HF_DTYPES.items()}[next(model.parameters()).dtype]
    return {"hf_config": model.hf_config.to_dict(), "dtype": dtype, "lora": model.lora,
            "hf_path": model.hf_path, "attention": model.attention}


def _rebuild(kwargs: dict[str, Any], seed: int) -> HFCausalLM:
    """The architecture, randomly initialized (the checkpoint's state_dict is loaded next)."""
    transformers = require_transformers()
    raw = dict(kwargs["hf_config"])
    config = transformers.AutoConfig.for_model(**raw)
    return HFCausalLM(config, seed=seed, dtype=HF_DTYPES[kwargs.get("dtype", "fp32")], lora=kwargs.get("lora"),
                      attention=kwargs.get("attention"))


def _max_seq_len(section) -> int | None:
    if section.name != "hf" or not (section.hf_path or section.hf_config):
        return None
    try:
        with open(config_file(section)) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("max_position_embeddings") or raw.get("n_positions")


def _cut_depth(raw: dict[str, Any], n_layer: int, tmpdir: str) -> None:
    """A copy of the section's config with num_hidden_layers=n_layer written into tmpdir and used
    as model.hf_config (random init: a plan probe measures memory, which the values do not
    change); per-layer lists such as layer_types are cut to match."""
    config = load_hf_config(SimpleNamespace(hf_path=raw.get("hf_path"), hf_config=raw.get("hf_config")))
    config.num_hidden_layers = n_layer
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layer]
    path = os.path.join(tmpdir, f"hf-config-{n_layer}-layers.json")
    # written whole, then renamed: ranks that cut the same config into one directory (verify's
    # workers) never read another's half-written file
    partial = f"{path}.tmp-{os.getpid()}"
    config.to_json_file(partial)
    os.replace(partial, path)
    raw.update(hf_path=None, hf_config=path)


def hf_vocab_size(section) -> int | None:
    try:
        with open(config_file(section)) as f:
            return json.load(f).get("vocab_size")
    except (OSError, TypeError, json.JSONDecodeError):
        return None


SPEC = ModelSpec(
    name="hf", keys=HFKeys, data_kind="tokens",
    build=build_hf, record=_record, rebuild=_rebuild, check=check_hf,
    synthetic=lambda section: {"vocab_size": hf_vocab_size(section) or 256},
    own_vocab=lambda section: hf_vocab_size(section) if section.hf_path else None,  # a config alone grows to the data's
    packing_problem=_packing_problem,
    max_seq_len=_max_seq_len,
    depth=lambda section: load_hf_config(section).num_hidden_layers,
    cut_depth=_cut_depth, loss_head=True)
