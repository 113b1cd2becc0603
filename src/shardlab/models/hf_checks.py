"""What `model.name=hf` checks before any worker starts (`check_hf`, `_packing_problem`: models/hf.py's SPEC):
the directory or config JSON, the dtype, the LoRA keys and targets, and the meta-device build with
what would stop shardlab from filling it (hf_load.build_problem, the router loss's family function),
each a one-line ConfigError naming the fix."""

from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import asdict
from types import SimpleNamespace

import torch
from torch import nn

from shardlab.errors import ConfigError
from shardlab.models.hf_load import INDEX_FILE, SINGLE_FILE, build_problem
from shardlab.models.hf_lora import _add_lora, attention_targets
from shardlab.models.hf_model import (
    HF_DTYPES,
    HFCausalLM,
    LoRAKeys,
    build_hf,
    config_file,
    load_hf_config,
    require_transformers,
)
from shardlab.models.safetensors_check import check_safetensors_dir


def check_hf(section) -> None:
    """model.name=hf's config check: each problem a one-line ConfigError naming the fix."""
    if section.name != "hf":
        return
    if (section.hf_path is None) == (section.hf_config is None):
        raise ConfigError("model.name=hf needs exactly one of model.hf_path (a local HF directory with config.json "
                          "and safetensors weights) or model.hf_config (a config JSON, random init)")
    _check_files(section)
    model_type = _model_type(section)
    if section.hf_dtype not in HF_DTYPES:
        raise ConfigError(f"model.hf_dtype: unknown value {section.hf_dtype!r}; valid: {', '.join(HF_DTYPES)}")
    lo = section.lora
    if lo.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0 = full fine-tuning), got {lo.rank}")
    if lo.rank and (lo.alpha <= 0 or not 0 <= lo.dropout < 1):
        raise ConfigError("model.lora.alpha must be > 0 and model.lora.dropout in [0, 1)")
    if lo.rank:
        problem = lora_target_problem(section, model_type) or lora_parameter_problem(section)
        if problem:
            raise ConfigError(problem)
    problem = _meta_build(section)[1]
    if problem:
        raise ConfigError(problem)


def _check_files(section) -> None:
    """model.hf_path holds config.json and safetensors files with sound headers, or model.hf_config
    names a config JSON."""
    if section.hf_path is not None:
        if not os.path.isfile(os.path.join(section.hf_path, "config.json")):
            raise ConfigError(f"model.hf_path {section.hf_path!r}: no config.json there; point it at a local "
                              "directory written by save_pretrained (nothing is downloaded)")
        if not any(os.path.isfile(os.path.join(section.hf_path, f)) for f in (INDEX_FILE, SINGLE_FILE)):
            raise ConfigError(f"model.hf_path {section.hf_path!r}: no {SINGLE_FILE} or {INDEX_FILE}; save the model "
                              "in safetensors (save_pretrained(..., safe_serialization=True))")
        check_safetensors_dir(section.hf_path)  # headers only: a corrupted file is named before any worker
    elif not os.path.isfile(config_file(section)):
        from shardlab.shipped import shipped_hf_configs

        raise ConfigError(f"model.hf_config {section.hf_config!r}: no such file; give a config JSON, a directory "
                          f"with config.json, or a shipped one's name ({', '.join(shipped_hf_configs())})")


def _model_type(section) -> str:
    """The config JSON's model_type, one the installed transformers knows."""
    try:
        with open(config_file(section)) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file(section)}:{e.lineno}: not valid JSON ({e.msg})") from None
    if "model_type" not in raw:
        raise ConfigError(f"{config_file(section)}: no \"model_type\" (e.g. \"mistral\", \"llama\", \"gpt2\"); "
                          "transformers needs it to pick the architecture")
    transformers = require_transformers()
    if raw["model_type"] not in transformers.CONFIG_MAPPING:  # else its refusal lists every type it knows
        raise ConfigError(f"{config_file(section)}: model_type {raw['model_type']!r} is unknown to the installed "
                          f"transformers {transformers.__version__}; upgrade transformers (pip install -U "
                          "transformers) if the model is newer than it, or correct model_type")
    return raw["model_type"]


def _section_key(section) -> tuple:
    path = config_file(section)
    return (section.hf_path, section.hf_config, section.hf_dtype, getattr(section, "hf_attention", None), path,
            os.path.getmtime(path))


def _meta_build(section) -> tuple[HFCausalLM | None, str | None]:
    """The model on the meta device and what stops shardlab from filling it (hf_load.build_problem),
    once per config (cached: validation runs on the launcher and in every worker)."""
    return _meta_build_cached(_section_key(section))


@functools.lru_cache(maxsize=16)
def _meta_build_cached(key: tuple) -> tuple[HFCausalLM | None, str | None]:
    hf_path, hf_config, hf_dtype, attention = key[:4]
    section = SimpleNamespace(name="hf", hf_path=hf_path, hf_config=hf_config, hf_dtype=hf_dtype,
                              hf_attention=attention, lora=LoRAKeys())

    try:
        with torch.device("meta"):
            model = build_hf(section, 0, None)
    except (ValueError, ImportError) as e:  # transformers refuses the implementation for this family
        if attention is None:
            raise
        return None, f"model.hf_attention={attention}: {str(e).splitlines()[0]}"
    return model, model.router_problem or build_problem(model, hf_path)


def _packing_problem(section) -> str | None:
    """data.packing=true: None when the model keeps packed examples apart under its attention
    implementation ([Note: packed sequences]), else why not."""
    model = _meta_build(section)[0]
    if model is None or model.packed_route() is not None:
        return None
    if not model.takes_4d_masks:
        return (f"data.packing=true: {type(model.hf_model).__name__} builds neither its mask from position ids nor "
                "takes a 4-D attention mask (Bloom: its ALiBi bias is built from a 2-D mask), so packed examples "
                "cannot be kept apart; set data.packing=false")
    return (f"data.packing=true: {type(model.hf_model).__name__} under attention {model.attention!r} has no known way "
            "to keep packed examples apart (transformers does not build its mask from the position ids, and this "
            "implementation takes no 4-D mask shardlab writes, or a sliding window would be lost); set "
            "data.packing=false, or model.hf_attention=eager or sdpa")


def lora_layer_names(section) -> dict[str, list[str]]:
    """Last name component -> full names of the modules LoRA can adapt (Linear, GPT-2's Conv1D,
    Embedding, Conv*d), from the architecture built on the meta device (no memory, no weights)."""
    transformers = require_transformers()
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(load_hf_config(section))
    kinds = (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d)
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if name and isinstance(m, kinds):
            out.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return out


def lora_target_problem(section, model_type: str) -> str | None:
    """What is wrong with model.lora.target_modules for this architecture (None: nothing), found
    before any worker starts; peft would fail with a traceback, or silently skip a bad name."""
    targets = section.lora.target_modules
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        if model_type in defaults:
            return None
    names = lora_layer_names(section)
    linear = sorted(names)
    if targets is None:
        transformers = require_transformers()
        with torch.device("meta"):
            if attention_targets(transformers.AutoModelForCausalLM.from_config(load_hf_config(section))):
                return None  # shardlab's default: the attention's Linear layers (models/hf_lora.py)
        return (f"model.lora.target_modules=null: peft has no default LoRA targets for model_type {model_type!r} "
                "and shardlab finds no attention layer to adapt; name them, e.g. "
                f"model.lora.target_modules=[{', '.join(linear[:2])}] (the layers LoRA can adapt in this model: "
                f"{', '.join(linear)})")
    full = {n for group in names.values() for n in group}
    unknown = [t for t in targets if t not in names and t not in full
               and not any(n.endswith("." + t) for n in full)]
    if unknown:
        return (f"model.lora.target_modules: {unknown} match{'es' if len(unknown) == 1 else ''} no layer of this "
                f"{model_type} model that LoRA can adapt; its Linear (and Conv1D, Embedding) layers: "
                f"{', '.join(linear)}")
    return None


def lora_parameter_problem(section) -> str | None:
    """Why the LoRA targets cannot train on shardlab's engines (None: they can): peft adapts the fused
    expert parameters of transformers 5's MoE blocks (DeepSeek-V3's `experts.down_proj`, matched by
    a `down_proj` target) through a parametrization of the parameter itself, which the engines'
    flat-buffer views of parameters do not carry (fsdp: 'has no parameter ... down_proj')."""
    transformers = require_transformers()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on patterns that matched nothing
        model = _add_lora(transformers.AutoModelForCausalLM.from_config(load_hf_config(section)), asdict(section.lora))
    wrapped = sorted({f"{n.removeprefix('base_model.model.').split('.base_layer')[0]}.{m.parameter_name}"
                      for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"})
    if not wrapped:
        return None
    return (f"model.lora.target_modules: peft would adapt the fused expert parameter {wrapped[0]} (and "
            f"{len(wrapped) - 1} more) by parametrization, which shardlab's engines do not support; name the Linear "
            "layers to adapt so that peft leaves the experts alone (e.g. the attention's q_proj, o_proj), or train "
            "the experts with full fine-tuning (model.lora.rank=0)")
