"""Issue 43's end-to-end check of mixtures of experts through the CLI (not part of the suite: about
a minute per run on 2 busy cores). For each family, a per-expert directory written by
`save_pretrained` (tests/hf_families.py's `write_family`) trains on fsdp at 2 ranks, with full
fine-tuning and with LoRA (default targets), exports (`export.format: hf`), and `shardlab eval
RUN/hf` is compared with transformers' own loss on the export over the same validation rows.

    .venv/bin/python -m tests.moe_cli_check OUT_DIR [mixtral qwen2_moe deepseek_v3]

Prints one JSON line per run: family, mode, seconds, shardlab eval's loss, transformers' loss and
their relative difference, and the router section of the run's metrics.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
MODES = {"full": [], "lora": ["model.lora.rank=4"]}


def shardlab(*args: str) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "shardlab")
    done = subprocess.run([exe, *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"shardlab {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def transformers_loss(hf_dir: str) -> float:
    """transformers' loss on the export over the rows and micro batches `shardlab eval` reads
    (loop/evaluate.py at one rank): cross-entropy of its logits plus coef x its aux_loss when the
    config asks for the router's loss, token-weighted over the micro batches."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from shardlab.data import build_datasets, collate
    from shardlab.export import _eval_config, load_model
    from shardlab.loop.evaluate import eval_rows

    model, info = load_model(hf_dir)
    cfg = _eval_config(info, model, None)
    val = build_datasets(cfg).val
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows, mb = eval_rows(val, cfg.train), cfg.train.micro_batch_size
    total = tokens = 0.0
    with torch.no_grad():
        for a in range(0, rows, mb):
            x, y = collate(val, torch.arange(a, min(a + mb, rows)))
            kwargs = {"input_ids": x[:, 0], "position_ids": x[:, 1]} if x.dim() == 3 else {"input_ids": x}
            if getattr(ref.config, "output_router_logits", False):
                kwargs["output_router_logits"] = True
            out = ref(**kwargs, use_cache=False)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100).item()
            if getattr(out, "aux_loss", None) is not None:
                loss += ref.config.router_aux_loss_coef * out.aux_loss.item()
            n = (y != -100).sum().item()
            total, tokens = total + loss * n, tokens + n
    return total / tokens


def check(out: str, name: str, mode: str) -> dict:
    from tests.hf_families import write_family

    directory = os.path.join(out, name)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        write_family(name, directory)
    run = f"{name}-{mode}"
    start = time.monotonic()
    shardlab("train", "configs/sft-mistral-tiny.yaml", "--nproc", "2", "model.hf_config=null",
             f"model.hf_path={directory}", "data.seq_len=48", "train.steps=3", f"output.dir={out}",
             f"output.run_name={run}", "output.progress=false", *MODES[mode])
    seconds = time.monotonic() - start
    hf_dir = os.path.join(out, run, "hf")
    ours = json.loads(shardlab("eval", hf_dir).strip().splitlines()[-1])["val_loss"]
    theirs = transformers_loss(hf_dir)
    with open(os.path.join(out, run, "metrics.json")) as f:
        router = json.load(f).get("router")
    return {"family": name, "mode": mode, "train_s": round(seconds, 1), "shardlab_eval": ours,
            "transformers": theirs, "rel": abs(ours - theirs) / abs(theirs), "router": router}


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:] or list(FAMILIES)
    for name in names:
        for mode in MODES:
            print(json.dumps(check(out, name, mode)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
