"""Hugging Face directories from shardlab models: `shardlab export RUN_DIR --format hf --out DIR`,
and `export.format=hf` at the end of training.

- model.name=hf: the transformers model itself (`save_pretrained`: config.json, safetensors,
  generation_config.json), with LoRA either merged into the weights (`export.lora=merged`, a
  plain model) or saved alone as a peft adapter (`export.lora=adapter`: adapter_config.json and
  adapter_model.safetensors, loaded on top of the base model with peft).
- model.name=gpt: a GPT-2 architecture directory (`GPT2LMHeadModel`): the same math (pre-LN
  blocks, exact GELU, learned positions, tied head), with its Linear weights transposed into
  GPT-2's Conv1D layout and zero biases where the shardlab model has none.
The tokenizer files are written beside the model when the run had a tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

import torch
from torch import nn

from shardlab.data.shards import TOKENIZER_COPY


def gpt_to_gpt2(model: nn.Module):
    """A transformers GPT2LMHeadModel computing what shardlab's GPT `model` computes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                        n_head=c.n_head, n_inner=4 * c.n_embd, activation_function="gelu", resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dtype = sd["tok_emb.weight"].dtype
    out: dict[str, torch.Tensor] = {"transformer.wte.weight": sd["tok_emb.weight"],
                                    "transformer.wpe.weight": sd["pos_emb.weight"]}

    def ln(src: str, dst: str, width: int) -> None:
        out[f"{dst}.weight"] = sd[f"{src}.weight"]
        out[f"{dst}.bias"] = sd.get(f"{src}.bias", torch.zeros(width, dtype=dtype))

    def linear(src: str, dst: str) -> None:  # nn.Linear [out, in] -> Conv1D [in, out]
        w = sd[f"{src}.weight"]
        out[f"{dst}.weight"] = w.t().contiguous()
        out[f"{dst}.bias"] = sd.get(f"{src}.bias", torch.zeros(w.shape[0], dtype=dtype))

    for i in range(c.n_layer):
        s, d = f"blocks.{i}", f"transformer.h.{i}"
        ln(f"{s}.ln_1", f"{d}.ln_1", c.n_embd)
        ln(f"{s}.ln_2", f"{d}.ln_2", c.n_embd)
        linear(f"{s}.attn.qkv", f"{d}.attn.c_attn")
        linear(f"{s}.attn.proj", f"{d}.attn.c_proj")
        linear(f"{s}.mlp.fc", f"{d}.mlp.c_fc")
        linear(f"{s}.mlp.proj", f"{d}.mlp.c_proj")
    ln("ln_f", "transformer.ln_f", c.n_embd)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(config)
    hf.load_state_dict(out, strict=False, assign=True)
    hf.tie_weights()
    missing = [n for n, p in hf.named_parameters() if p.device.type == "meta"]
    if missing:
        raise RuntimeError(f"GPT-2 export left parameters unset: {missing[:5]}")
    return hf.to(dtype).eval()


def model_from_state(record: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """The model of `record` holding `state`, built on the meta device and filled without a
    random init (a 7B export does not first draw 7B random numbers). An hf model takes the state
    and derives the rest as every other construction does (HFCausalLM.load_state_)."""
    from shardlab.models import rebuild_model

    model = rebuild_model(record, "meta")
    if record["name"] == "hf":
        model.load_state_(state)
        if getattr(model.hf_config, "tie_word_embeddings", False):
            model.hf_model.tie_weights()
        return model.eval()
    model.load_state_dict(state, strict=True, assign=True)
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    if record["name"] == "gpt":
        model.lm_head.weight = model.tok_emb.weight
    return model.eval()


RUN_CONFIG = "shardlab_config.yaml"  # the run's resolved config, beside the model: `shardlab eval DIR` reads it


@contextlib.contextmanager
def transformers_progress(show: bool):
    """transformers' (and huggingface_hub's) tqdm bars ("Writing model shards", ...) on or off
    for the block: `shardlab export` follows output.progress, a training run's export has none."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not show:
            hf_logging.enable_progress_bar()


def export_hf(model: nn.Module, out_dir: str, *, tokenizer_dir: str | None = None, lora: str = "merged",
              base_model: str | None = None, run_config: dict[str, Any] | None = None, progress: bool = True) -> str:
    """Write `model` (shardlab's HFCausalLM or GPT) as a Hugging Face directory; returns out_dir.
    base_model: the local directory the weights came from (model.hf_path), which a LoRA adapter
    names as its base (`base_model_name_or_path`); run_config: the run's config (-> RUN_CONFIG);
    progress: transformers' progress bars (output.progress)."""
    with transformers_progress(progress):
        return _export_hf(model, out_dir, tokenizer_dir, lora, base_model, run_config)


def _export_hf(model: nn.Module, out_dir: str, tokenizer_dir: str | None, lora: str, base_model: str | None,
               run_config: dict[str, Any] | None) -> str:
    from shardlab.models.gpt import GPT
    from shardlab.models.hf import HFCausalLM

    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(model, GPT):
        hf = gpt_to_gpt2(model)
        hf.save_pretrained(tmp)
    elif isinstance(model, HFCausalLM):
        if model.lora is not None and lora == "adapter":
            # a random init (model.hf_config) has no base directory: the base weights are only in the checkpoint
            model.model.peft_config["default"].base_model_name_or_path = os.path.abspath(base_model) if base_model \
                else None
            model.model.save_pretrained(tmp)  # peft: adapter_config.json + adapter_model.safetensors
        else:
            hf = model.model.merge_and_unload() if model.lora is not None else model.model
            hf.save_pretrained(tmp)
    else:
        raise TypeError(f"export --format hf takes model.name=hf or gpt, not {type(model).__name__}")
    if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        from shardlab.data.sft import SFTTokenizer

        SFTTokenizer(tokenizer_dir).save(tmp)
    if run_config is not None:
        import yaml

        with open(os.path.join(tmp, RUN_CONFIG), "w") as f:
            yaml.safe_dump(run_config, f, sort_keys=False)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def run_tokenizer_dir(run_dir: str | None, config: dict[str, Any] | None) -> str | None:
    """The tokenizer a run used: <run dir>/tokenizer (copied there by training), else the config's,
    else a prepared corpus's own copy (<data.path>/tokenizer); None: none (a GPT then uses bytes)."""
    candidates = []
    if run_dir:
        candidates.append(os.path.join(run_dir, "tokenizer"))
    data = (config or {}).get("data", {})
    model = (config or {}).get("model", {})
    candidates += [data.get("tokenizer_path"), data.get("tokenizer"), model.get("hf_path"),
                   os.path.join(data["path"], TOKENIZER_COPY) if data.get("path") else None]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "tokenizer.json")):
            return c
    return None


def export_at_end(run) -> str | None:
    """export.format=hf after training: every rank gathers the full state (a collective), rank 0
    rebuilds the model from it and writes the directory (export.dir, default <run dir>/hf)."""
    import shardlab
    from shardlab.engines import engine_of
    from shardlab.models import model_record

    cfg = run.cfg
    state = shardlab.full_state_dict(run.model)
    if not run.rt.is_main:
        return None
    record = model_record(cfg.model.name, engine_of(run.model).unwrapped(), cfg.seed)
    model = model_from_state(record, state)
    out = cfg.export.dir or os.path.join(run.out_dir, "hf")
    tok = run_tokenizer_dir(run.out_dir, cfg.to_dict())
    # no bars: a worker's stderr is read back as warnings ([Note: progress for terminals and for logs]
    # in loop/measurements.py), and the run's own progress already says where it is
    return export_hf(model, out, tokenizer_dir=tok, lora=cfg.export.lora,
                     base_model=(record.get("kwargs") or {}).get("hf_path"), run_config=cfg.to_dict(),
                     progress=False)


# -- reading a Hugging Face directory back (shardlab generate / eval) ---------------------------------
def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("config.json", "adapter_config.json"))


def load_hf_dir(path: str, hf_dtype: str = "fp32") -> nn.Module:
    """A local Hugging Face directory as shardlab's HFCausalLM on CPU, checked and built as training
    does (`shardlab.models.build_model` of a model section naming the directory): a whole model
    (config.json + safetensors, read as model.hf_path is), or a peft adapter (adapter_config.json)
    on top of the base directory it names (`base_model_name_or_path`)."""
    import json
    from types import SimpleNamespace

    from shardlab.checkpoint import CheckpointError
    from shardlab.models import build_model, model_spec
    from shardlab.models.hf import LoRAKeys

    adapter_file = os.path.join(path, "adapter_config.json")
    section = SimpleNamespace(name="hf", hf_path=path, hf_config=None, hf_dtype=hf_dtype, lora=LoRAKeys())
    check = model_spec("hf").check  # what training checks of model.hf_path: a ConfigError naming the fix
    if not os.path.isfile(adapter_file):
        check(section)
        return build_model(section).eval()
    with open(adapter_file) as f:
        a = json.load(f)
    base = a.get("base_model_name_or_path")
    if not base or not os.path.isfile(os.path.join(base, "config.json")):
        raise CheckpointError(f"{path} is a LoRA adapter whose base model directory ({base!r}, its "
                              "base_model_name_or_path) is not on this machine; an adapter of a randomly initialized "
                              "model has none: export that run with --lora merged")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    targets = a.get("target_modules")
    section.hf_path = base
    section.lora = LoRAKeys(rank=a["r"], alpha=a["lora_alpha"], dropout=a.get("lora_dropout", 0.0),
                            target_modules=sorted(targets) if isinstance(targets, list) else targets)
    check(section)
    model = build_model(section)
    set_peft_model_state_dict(model.model, load_file(os.path.join(path, "adapter_model.safetensors")))
    return model.eval()


def hf_dir_run_config(path: str) -> dict[str, Any] | None:
    """The config of the run that wrote HF directory `path`: its RUN_CONFIG, or the run directory's
    config.yaml when `path` is <run dir>/hf."""
    import yaml

    for candidate in (os.path.join(path, RUN_CONFIG), os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                   "config.yaml")):
        if os.path.isfile(candidate):
            with open(candidate) as f:
                return yaml.safe_load(f)
    return None
