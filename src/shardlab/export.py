"""Use a trained model outside training: `shardlab export`, `shardlab generate`, `shardlab eval`.

  shardlab export RUN_DIR [--step S] --out model.safetensors
      consolidate a sharded checkpoint into one safetensors file (original state_dict names,
      tied names included), in this process alone: no process group, no GPUs.
  shardlab generate MODEL --prompt "def " [--max-new-tokens 200] [--chat]
      sample text: MODEL is an exported GPT (.safetensors), a run directory, or a Hugging Face
      directory (exported, `<run dir>/hf`, or a peft adapter with its base); --chat wraps the
      prompt in the template the model was fine-tuned with.
  shardlab eval RUN_DIR|CHECKPOINT_DIR|model.safetensors|HF_DIR [--config CONFIG.yaml]
      the validation loss of the model, on the validation split of the run's data config (an HF
      directory exported by shardlab carries it; otherwise --config gives one).

The safetensors metadata holds what it takes to rebuild the model and its data: the model
description (GPT config or model kwargs) and the resolved run config, as JSON strings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from shardlab.checkpoint import (
    CheckpointError,
    build_model_from_record,
    list_checkpoints,
    read_model_state,
    resolve_checkpoint,
    step_dir_name,
)
from shardlab.config import config_from_dict

METADATA_KEY = "shardlab"


def checkpoint_path(run_or_checkpoint: str, step: int | None = None) -> str:
    """The checkpoint directory to read: a given step of a run, or the latest complete one."""
    if step is None:
        return resolve_checkpoint(run_or_checkpoint)
    for root in (run_or_checkpoint, os.path.join(run_or_checkpoint, "checkpoints")):
        for s, path in list_checkpoints(root):
            if s == step:
                return path
    raise CheckpointError(f"no complete checkpoint of step {step} ({step_dir_name(step)}) under {run_or_checkpoint}")


def export_checkpoint(checkpoint: str, out: str) -> dict[str, Any]:
    """Write the consolidated model of a checkpoint to a safetensors file; returns its metadata."""
    from safetensors.torch import save_file

    state, manifest = read_model_state(checkpoint)
    info = {"model": manifest.get("model"), "config": manifest.get("config"), "step": manifest["step"],
            "strategy": manifest["strategy"], "world_size": manifest["world_size"],
            "checkpoint": os.path.abspath(checkpoint)}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt", METADATA_KEY: json.dumps(info)})
    os.replace(tmp, out)
    return info


def load_exported(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if METADATA_KEY not in meta:
            raise CheckpointError(f"{path} was not written by `shardlab export` (no {METADATA_KEY!r} metadata); the "
                                  "model config is unknown")
        return load_file(path), json.loads(meta[METADATA_KEY])
    except SafetensorError as e:  # any file can be named here: a text file, a .bin, a torn copy
        raise CheckpointError(f"{path} is not a safetensors file ({e}); give a .safetensors file written by "
                              "`shardlab export`, a run directory or a Hugging Face directory") from None


def load_model(source: str, step: int | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """A plain (unwrapped) model on CPU from an exported file, a checkpoint, a run directory or a
    Hugging Face directory; info: model record ("name"), run config, step, tokenizer directory."""
    from shardlab.export_hf import hf_dir_run_config, is_hf_dir, load_hf_dir, run_tokenizer_dir

    if is_hf_dir(source):
        tok = source if os.path.isfile(os.path.join(source, "tokenizer.json")) else None
        config = hf_dir_run_config(source)
        dtype = ((config or {}).get("model") or {}).get("hf_dtype") or "fp32"  # the dtype the run trained in
        return load_hf_dir(source, dtype), {"model": {"name": "hf"}, "config": config, "step": None,
                                            "tokenizer_dir": tok, "hf_dir": source}
    if os.path.isfile(source):
        state, info = load_exported(source)
    else:
        state, manifest = read_model_state(checkpoint_path(source, step))
        info = {"model": manifest.get("model"), "config": manifest.get("config"), "step": manifest["step"]}
    if not info.get("model"):
        raise CheckpointError(f"{source}: no model description stored (saved without a run config); "
                              "cannot rebuild the model")
    model = build_model_from_record(info["model"], "cpu")
    model.load_state_dict(state)
    model.eval()
    run_dir = source if os.path.isfile(os.path.join(source, "config.yaml")) else None
    info["tokenizer_dir"] = run_tokenizer_dir(run_dir, info.get("config"))
    return model, info


def evaluate_model(model: nn.Module, cfg, batches: int | None = None) -> float | None:
    from shardlab.data import build_datasets
    from shardlab.loop.evaluate import evaluate
    from shardlab.loop.runtime import Runtime

    if batches is not None:
        cfg.train.eval_batches = batches
    data = build_datasets(cfg)
    rt = Runtime(0, 0, 1, torch.device("cpu"), None)
    return evaluate(model, data.val, cfg.train, rt)


# ---------------------------------------------------------------------------------------- commands
def _export_cmd(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _export_hf_cmd(args)
    try:
        path = checkpoint_path(args.run, args.step)
        info = export_checkpoint(path, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported step {info['step']} of {path} ({info['strategy']} at world size {info['world_size']}) "
          f"to {args.out}")
    return 0


def _export_hf_cmd(args: argparse.Namespace) -> int:
    """A Hugging Face directory (config.json, safetensors, tokenizer, generation_config.json)."""
    from shardlab.export_hf import export_hf, model_from_state, run_tokenizer_dir

    try:
        path = checkpoint_path(args.run, args.step)
        state, manifest = read_model_state(path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record = manifest.get("model")
    if not record or record.get("name") not in ("hf", "gpt"):
        print(f"error: {path}: --format hf exports model.name=hf or gpt checkpoints, not "
              f"{(record or {}).get('name')}", file=sys.stderr)
        return 1
    config = manifest.get("config") or {}
    lora = args.lora or config.get("export", {}).get("lora", "merged")
    run_dir = args.run if os.path.isfile(os.path.join(args.run, "config.yaml")) else None
    out = export_hf(model_from_state(record, state), args.out, tokenizer_dir=run_tokenizer_dir(run_dir, config),
                    lora=lora, base_model=(record.get("kwargs") or {}).get("hf_path"), run_config=config or None,
                    progress=config.get("output", {}).get("progress", True))
    print(f"exported step {manifest['step']} of {path} as a Hugging Face directory: {out}")
    return 0


def _generate_cmd(args: argparse.Namespace) -> int:
    from shardlab.config import ConfigError
    from shardlab.data.text import Tokenizer

    try:
        model, info = load_model(args.model)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if info["model"]["name"] == "hf":
        return _generate_hf(model, info, args)
    if info["model"]["name"] != "gpt":
        print(f"error: {args.model} holds a {info['model']['name']} model; generate needs a GPT or an hf model",
              file=sys.stderr)
        return 1
    tok = Tokenizer(info.get("tokenizer_dir"))  # None: bytes
    ids = tok.encode(args.prompt)
    if ids.numel() == 0:
        print("error: --prompt must not be empty", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(ids.view(1, -1), args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, generator=gen)
    print(tok.decode(out[0].tolist()))
    return 0


def _generate_hf(model: nn.Module, info: dict[str, Any], args: argparse.Namespace) -> int:
    """Sample from a transformers model (HFCausalLM) with the run's tokenizer, stopping at its EOS."""
    from shardlab.data.sft import SFTTokenizer

    if not info.get("tokenizer_dir"):
        print(f"error: {args.model}: no tokenizer.json found with the model (or in the run directory)", file=sys.stderr)
        return 1
    tok = SFTTokenizer(info["tokenizer_dir"])
    ids = tok.prompt_ids(args.prompt) if args.chat else [t for t in [tok.bos_id] if t is not None] + tok.encode(args.prompt)
    torch.manual_seed(args.seed)
    x = torch.tensor([ids])
    sampling = ({"do_sample": True, "temperature": args.temperature, "top_k": args.top_k or 0}
                if args.temperature > 0 else {"do_sample": False})  # temperature 0: greedy
    out = model.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                               eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **sampling)
    print(tok.tok.decode(out[0, len(ids):] if args.chat else out[0], skip_special_tokens=True))
    return 0


def _eval_config(info: dict[str, Any], model: nn.Module, config_path: str | None):
    """The config whose validation split `shardlab eval` reads: the run's (or --config's); for a
    Hugging Face directory its model section points at the directory and its tokenizer."""
    from shardlab.config import load_config

    raw = info.get("config") or (load_config(config_path).to_dict() if config_path else None)
    if raw is None or not info.get("hf_dir"):
        return None if raw is None else config_from_dict(raw)
    raw = {**raw, "model": {**raw.get("model", {}), "name": "hf", "hf_path": model.hf_path, "hf_config": None,
                            "lora": {"rank": 0}}}
    if info.get("tokenizer_dir"):
        raw["data"] = {**raw.get("data", {}), "tokenizer_path": info["tokenizer_dir"]}
    return config_from_dict(raw)


def _eval_cmd(args: argparse.Namespace) -> int:
    from shardlab.config import ConfigError

    try:
        model, info = load_model(args.source, args.step)
        cfg = _eval_config(info, model, args.config)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if cfg is None:
        print(f"error: {args.source}: no run config stored with it, so the validation data is unknown; give "
              "--config CONFIG.yaml (its data section says what to evaluate on)", file=sys.stderr)
        return 1
    loss = evaluate_model(model, cfg, args.batches)
    if loss is None:
        print(f"error: the data has no validation rows (data.val_fraction={cfg.data.val_fraction} of its examples "
              "rounds to 0); raise data.val_fraction", file=sys.stderr)
        return 1
    print(json.dumps({"source": args.source, "step": info.get("step"), "val_loss": loss}))
    return 0


def _at_least(low: float, kind: type = int, note: str = ""):
    """An argparse type: a number of `kind` >= low. argparse names the flag in its error, and the
    command stops there, before any model is loaded."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value >= low:  # NaN is refused too
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} >= {low}{note}, got {text}")
        return value

    return parse


def add_export_parsers(subparsers) -> None:
    ex = subparsers.add_parser("export", help="consolidate a sharded checkpoint into one safetensors file",
                               description="Read a sharded checkpoint in one process (no process group) and "
                                           "write the full model with its original parameter names.")
    ex.add_argument("run", metavar="RUN_DIR", help="a run directory, its checkpoints/ directory or a step_* checkpoint")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest complete one)")
    ex.add_argument("--out", required=True, help="output file (model.safetensors), or directory with --format hf")
    ex.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                    help="safetensors: one file of shardlab's names; hf: a Hugging Face directory that "
                         "transformers' from_pretrained loads (model.name=hf, or gpt as GPT2LMHeadModel)")
    ex.add_argument("--lora", choices=("merged", "adapter"), default=None,
                    help="with --format hf and LoRA: merge adapters into the weights, or save the adapter "
                         "alone (default: the run's export.lora)")
    ex.set_defaults(func=_export_cmd)

    ge = subparsers.add_parser("generate", help="sample text from a trained or exported model",
                               description="Sample text from a GPT exported by `shardlab export`, a run directory, "
                                           "or a Hugging Face directory (model or peft adapter).")
    ge.add_argument("model", metavar="MODEL", help="a .safetensors file from `shardlab export`, a run directory or a "
                                                   "Hugging Face directory")
    ge.add_argument("--chat", action="store_true",
                    help="hf models: wrap the prompt in the fine-tuning template (the tokenizer's chat template, "
                         "else docs/sft.md's) and print only the answer")
    ge.add_argument("--prompt", required=True)
    ge.add_argument("--max-new-tokens", type=_at_least(1), default=200)
    ge.add_argument("--temperature", type=_at_least(0, float, " (0: always the likeliest token)"), default=0.8)
    ge.add_argument("--top-k", type=_at_least(1, note=" (leave it out to sample from every token)"), default=None,
                    help="sample from the K likeliest tokens only")
    ge.add_argument("--seed", type=int, default=0)
    ge.set_defaults(func=_generate_cmd)

    ev = subparsers.add_parser("eval", help="validation loss of a run's checkpoint or an exported model",
                               description="Report the validation loss on the run's validation split.")
    ev.add_argument("source", metavar="RUN_DIR|MODEL", help="a run directory, a checkpoint, a .safetensors file or a "
                                                            "Hugging Face directory")
    ev.add_argument("--config", default=None, metavar="CONFIG.yaml",
                    help="the data to evaluate on, for a model stored without its run config")
    ev.add_argument("--step", type=int, default=None, help="with a run directory: the checkpoint's step")
    ev.add_argument("--batches", type=_at_least(1), default=None,
                    help="validation batches (default: train.eval_batches)")
    ev.set_defaults(func=_eval_cmd)
