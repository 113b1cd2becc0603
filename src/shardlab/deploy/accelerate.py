"""`shardlab render accelerate`: an accelerate config for FSDP2 and a per-node launch script.

For users who run Hugging Face Trainer (or any accelerate) scripts on the same nodes. The
launch script runs shardlab's own trainer with the resolved config when given no script,
so the rendered directory is usable as-is; give it `train.py --args` to run your own.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardlab.deploy.common import (
    RESOLVED_CONFIG_NAME,
    DeployTarget,
    RenderError,
    check_positive,
    resolve_config,
    sh_quote,
    write_files,
)
from shardlab.deploy.templating import fill

ACCELERATE_CONFIG_NAME = "accelerate-fsdp.yaml"
LAUNCH_SCRIPT_NAME = "launch-accelerate.sh"
SHARDLAB_BLOCK_CLASS = "Block"     # shardlab.models.gpt.Block: one FSDP unit per transformer block
MIXED_PRECISION = ("fp16", "bf16", "no")

LAUNCH_TEMPLATE = r"""#!/bin/bash
# Rendered by `shardlab render accelerate`. Run it once on every node:
#   MACHINE_RANK=<0..@last_rank> MAIN_PROCESS_IP=<node 0 address> @script_path [script.py args...]
# Under Slurm (one task per node) or an Indexed Job the machine rank is read from
# SLURM_NODEID or JOB_COMPLETION_INDEX. With no script, shardlab's trainer runs the config
# rendered beside this file.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

MACHINE_RANK="${MACHINE_RANK:-${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-0}}}"
args=(--config_file "$HERE/@accelerate_config" --machine_rank "$MACHINE_RANK")
if [ -n "${MAIN_PROCESS_IP:-}" ]; then
    args+=(--main_process_ip "$MAIN_PROCESS_IP")
fi
if [ "$#" -eq 0 ]; then
    set -- -m shardlab train "$HERE/@resolved_config"
fi
exec @accelerate launch "${args[@@]}" "$@@"
"""


@dataclass
class AccelerateRequest:
    config: str | None
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    out: Path
    layer_cls: str = SHARDLAB_BLOCK_CLASS
    mixed_precision: str = "fp16"       # T4 (Turing) has no bf16; Ampere and newer: bf16
    main_process_ip: str | None = None
    main_process_port: int = 29500
    accelerate: str = "accelerate"
    cpu_ram_efficient_loading: bool = True
    activation_checkpointing: bool = False


def accelerate_config(req: AccelerateRequest) -> dict:
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": req.mixed_precision,
        "num_machines": req.nodes,
        "num_processes": req.nodes * req.gpus_per_node,   # accelerate counts processes over all machines
        "machine_rank": 0,                                # the launch script passes each node's rank
        "main_process_port": req.main_process_port,
        "rdzv_backend": "c10d" if req.nodes > 1 else "static",
        "same_network": True,
        "use_cpu": False,
        "fsdp_config": {
            "fsdp_version": 2,             # always explicit: accelerate's default is still FSDP1
            "fsdp_reshard_after_forward": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": req.layer_cls,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": req.cpu_ram_efficient_loading,
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": req.activation_checkpointing,
        },
    }
    if req.main_process_ip:
        cfg["main_process_ip"] = req.main_process_ip
    return cfg


def render(req: AccelerateRequest) -> tuple[list[Path], str]:
    check_positive(req.nodes, "--nodes")
    check_positive(req.gpus_per_node, "--gpus-per-node")   # FSDP through accelerate needs GPUs
    if req.mixed_precision not in MIXED_PRECISION:
        raise RenderError(f"--mixed-precision must be one of {MIXED_PRECISION}, got {req.mixed_precision!r}")
    if not req.layer_cls.isidentifier():
        raise RenderError(f"--layer-cls {req.layer_cls!r} must be a class name such as LlamaDecoderLayer")
    run = resolve_config(req.config, req.overrides, req.nodes * req.gpus_per_node)
    if req.nodes > 1 and not req.main_process_ip:
        print("note: no --main-process-ip; set MAIN_PROCESS_IP on every node before running the launch script")
    out = req.out.resolve()
    script = fill(LAUNCH_TEMPLATE, last_rank=req.nodes - 1, script_path=sh_quote(str(out / LAUNCH_SCRIPT_NAME)),
                  accelerate_config=ACCELERATE_CONFIG_NAME, resolved_config=RESOLVED_CONFIG_NAME,
                  accelerate=sh_quote(req.accelerate))
    header = ("# Rendered by `shardlab render accelerate`: FSDP2 for "
              f"{req.nodes} machine(s) x {req.gpus_per_node} GPU(s).\n")
    files = {
        ACCELERATE_CONFIG_NAME: header + yaml.safe_dump(accelerate_config(req), sort_keys=False),
        LAUNCH_SCRIPT_NAME: script,
        RESOLVED_CONFIG_NAME: run.yaml_text,
    }
    written = write_files(out, files, executable=(LAUNCH_SCRIPT_NAME,))
    hint = (f"accelerate launch --config_file {sh_quote(str(out / ACCELERATE_CONFIG_NAME))} your_script.py"
            f"   # or on each node: MACHINE_RANK=<i> {sh_quote(str(out / LAUNCH_SCRIPT_NAME))}")
    return written, hint


# -- the command (shardlab render accelerate) --------------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer-cls", default="Block",
                   help="transformer layer class to wrap (shardlab GPT: Block; HF: e.g. LlamaDecoderLayer)")
    p.add_argument("--mixed-precision", default="fp16", choices=["fp16", "bf16", "no"],
                   help="fp16 for T4 (default); bf16 on Ampere or newer")
    p.add_argument("--main-process-ip", default=None, help="address of machine 0 (multi-node)")
    p.add_argument("--main-process-port", type=int, default=29500)


def _render_args(args: argparse.Namespace, common: dict) -> tuple[list[Path], str]:
    if args.max_restarts != 3:
        print("note: --max-restarts does not apply to accelerate configs", file=sys.stderr)
    return render(AccelerateRequest(
        **common, layer_cls=args.layer_cls, mixed_precision=args.mixed_precision,
        main_process_ip=args.main_process_ip, main_process_port=args.main_process_port))


TARGET = DeployTarget("accelerate", "an accelerate FSDP2 config and a per-node launch script", _add_arguments,
                      _render_args)
