"""Use a trained model outside training: `shardlab export`, `shardlab generate`, `shardlab eval`.

  shardlab export RUN_DIR [--step S] --out model.safetensors
      consolidate a sharded checkpoint into one safetensors file (original state_dict names,
      tied names included), in this process alone: no process group, no GPUs.
  shardlab generate model.safetensors --prompt "def " [--max-new-tokens 200]
      sample text from an exported GPT (byte-level, or the run's tokenizer directory).
  shardlab eval RUN_DIR|CHECKPOINT_DIR|model.safetensors
      the validation loss of the model, on the validation split of the run's data config.

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
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if METADATA_KEY not in meta:
        raise CheckpointError(f"{path} was not written by `shardlab export` (no {METADATA_KEY!r} metadata); the "
                              "model config is unknown")
    return load_file(path), json.loads(meta[METADATA_KEY])


def load_model(source: str, step: int | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """A plain (unwrapped) model on CPU from an exported file, a checkpoint or a run directory."""
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
    return model, info


def evaluate_model(model: nn.Module, cfg, batches: int | None = None) -> float | None:
    from shardlab.data import build_datasets
    from shardlab.evaluate import evaluate
    from shardlab.runtime import Runtime

    if batches is not None:
        cfg.train.eval_batches = batches
    data = build_datasets(cfg)
    rt = Runtime(0, 0, 1, torch.device("cpu"), None)
    return evaluate(model, data.val, cfg, rt)


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
                    lora=lora)
    print(f"exported step {manifest['step']} of {path} as a Hugging Face directory: {out}")
    return 0


def _generate_cmd(args: argparse.Namespace) -> int:
    from shardlab.data.text import Tokenizer

    try:
        model, info = load_model(args.model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if info["model"]["name"] != "gpt":
        print(f"error: {args.model} holds a {info['model']['name']} model; generate needs a GPT", file=sys.stderr)
        return 1
    tok_dir = (info.get("config") or {}).get("data", {}).get("tokenizer")
    tok = Tokenizer(tok_dir if tok_dir and os.path.isdir(tok_dir) else None)
    ids = tok.encode(args.prompt)
    if ids.numel() == 0:
        print("error: --prompt must not be empty", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(ids.view(1, -1), args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, generator=gen)
    print(tok.decode(out[0].tolist()))
    return 0


def _eval_cmd(args: argparse.Namespace) -> int:
    try:
        model, info = load_model(args.source, args.step)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not info.get("config"):
        print(f"error: {args.source}: no run config stored, so the validation data is unknown", file=sys.stderr)
        return 1
    loss = evaluate_model(model, config_from_dict(info["config"]), args.batches)
    if loss is None:
        print("error: the run's data has no validation split (data.val_fraction=0?)", file=sys.stderr)
        return 1
    print(json.dumps({"source": args.source, "step": info.get("step"), "val_loss": loss}))
    return 0


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

    ge = subparsers.add_parser("generate", help="sample text from an exported GPT",
                               description="Sample text from a GPT exported by `shardlab export`.")
    ge.add_argument("model", metavar="MODEL", help="a .safetensors file from `shardlab export` (or a run directory)")
    ge.add_argument("--prompt", required=True)
    ge.add_argument("--max-new-tokens", type=int, default=200)
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--top-k", type=int, default=None)
    ge.add_argument("--seed", type=int, default=0)
    ge.set_defaults(func=_generate_cmd)

    ev = subparsers.add_parser("eval", help="validation loss of a run's checkpoint or an exported model",
                               description="Report the validation loss on the run's validation split.")
    ev.add_argument("source", metavar="RUN_DIR|MODEL", help="a run directory, a checkpoint or a .safetensors file")
    ev.add_argument("--step", type=int, default=None, help="with a run directory: the checkpoint's step")
    ev.add_argument("--batches", type=int, default=None, help="validation batches (default: train.eval_batches)")
    ev.set_defaults(func=_eval_cmd)
