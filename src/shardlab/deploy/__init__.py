"""Render and submit shardlab runs for Slurm, Kubernetes and accelerate.

The CLI calls `add_render_parser(subparsers)` and `add_submit_parser(subparsers)`; each
adds one subcommand whose `func(args)` returns the exit code: 0 done, 2 bad request
(nothing written), 1 the submit command failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from shardlab.deploy.common import RenderError

__all__ = ["add_render_parser", "add_submit_parser", "RenderError"]

def _add_common(p: argparse.ArgumentParser, target: str) -> None:
    p.add_argument("config", metavar="CONFIG.yaml", help="shardlab config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=100")
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="GPUs per machine; 0 = CPU workers with gloo (slurm, k8s) (default 1)")
    p.add_argument("--out", type=Path, default=None, help=f"output directory (default deploy/{target})")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun agent restarts before giving up (default 3)")


def _add_slurm(p: argparse.ArgumentParser) -> None:
    _add_common(p, "slurm")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers per node (default: --gpus-per-node, or 1 on CPU nodes)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node's task (default 4 per GPU, 2 on CPU)")
    p.add_argument("--job-name", default="shardlab")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--account", default=None)
    p.add_argument("--qos", default=None)
    p.add_argument("--time", dest="time_limit", default="01:00:00", help="time limit (default 01:00:00)")
    p.add_argument("--mem", default=None, help="memory per node, e.g. 64G (default: the cluster's default)")
    p.add_argument("--rdzv-port", type=int, default=29500)
    p.add_argument("--socket-ifname", default=None,
                   help="network interface for NCCL and gloo (default: NCCL avoids lo/docker0, gloo picks)")
    p.add_argument("--python", default="python3", help="Python on the compute nodes that has shardlab installed")
    p.add_argument("--setup", default="", help="shell line run before training, e.g. 'source ~/venv/bin/activate'")
    p.add_argument("--workdir", default=None, help="job working directory (default: the current directory)")
    p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=True,
                   help="#SBATCH --requeue, and `scontrol requeue` after a preemption save (default: on; "
                        "docs/preemption.md)")


def _add_k8s(p: argparse.ArgumentParser) -> None:
    _add_common(p, "k8s")
    p.add_argument("--image", default="shardlab:0.1.0", help="container image (Artifact Registry path, tag or @digest)")
    p.add_argument("--name", default="shardlab-train", help="Job / Service name")
    p.add_argument("--namespace", default="shardlab")
    p.add_argument("--bucket", default="shardlab-data", help="GCS bucket for checkpoints and data (terraform output)")
    p.add_argument("--service-account", default="shardlab-trainer",
                   help="Kubernetes service account bound to the bucket by workload identity")
    p.add_argument("--accelerator", default="nvidia-tesla-t4", help="value of cloud.google.com/gke-accelerator")
    p.add_argument("--cpu-per-node", default="4", help="CPU request per pod (default 4)")
    p.add_argument("--memory-per-node", default="16Gi", help="memory request and limit per pod (default 16Gi)")
    p.add_argument("--shm-size", default="8Gi", help="size limit of the /dev/shm memory volume (default 8Gi)")
    p.add_argument("--no-namespace-object", dest="create_namespace", action="store_false",
                   help="do not create the Namespace (it exists already)")


def _add_accelerate(p: argparse.ArgumentParser) -> None:
    _add_common(p, "accelerate")
    p.add_argument("--layer-cls", default="Block",
                   help="transformer layer class to wrap (shardlab GPT: Block; HF: e.g. LlamaDecoderLayer)")
    p.add_argument("--mixed-precision", default="fp16", choices=["fp16", "bf16", "no"],
                   help="fp16 for T4 (default); bf16 on Ampere or newer")
    p.add_argument("--main-process-ip", default=None, help="address of machine 0 (multi-node)")
    p.add_argument("--main-process-port", type=int, default=29500)


def _out(args: argparse.Namespace) -> Path:
    return args.out if args.out is not None else Path("deploy") / args.target


def _render(args: argparse.Namespace):
    """Build the request for args.target and render it; returns (files, submit hint)."""
    common = dict(config=args.config, overrides=list(args.overrides), nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, out=_out(args))
    if args.target == "slurm":
        from shardlab.deploy import slurm
        return slurm.render(slurm.SlurmRequest(
            **common, nproc_per_node=args.nproc_per_node, cpus_per_task=args.cpus_per_task,
            job_name=args.job_name, partition=args.partition, account=args.account, qos=args.qos,
            time_limit=args.time_limit, mem=args.mem, max_restarts=args.max_restarts, rdzv_port=args.rdzv_port,
            socket_ifname=args.socket_ifname, python=args.python, setup=args.setup, workdir=args.workdir,
            requeue=args.requeue))
    if args.target == "k8s":
        from shardlab.deploy import k8s
        return k8s.render(k8s.K8sRequest(
            **common, name=args.name, namespace=args.namespace, image=args.image, bucket=args.bucket,
            service_account=args.service_account, accelerator=args.accelerator, cpu_per_node=args.cpu_per_node,
            memory_per_node=args.memory_per_node, shm_size=args.shm_size, max_restarts=args.max_restarts,
            create_namespace=args.create_namespace))
    from shardlab.deploy import accelerate
    if args.max_restarts != 3:
        print("note: --max-restarts does not apply to accelerate configs", file=sys.stderr)
    return accelerate.render(accelerate.AccelerateRequest(
        **common, layer_cls=args.layer_cls, mixed_precision=args.mixed_precision,
        main_process_ip=args.main_process_ip, main_process_port=args.main_process_port))


def cmd_render(args: argparse.Namespace) -> int:
    try:
        written, hint = _render(args)
    except RenderError as e:
        print(f"shardlab render {args.target}: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"submit with: {hint}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        written, _hint = _render(args)
        if args.target == "slurm":
            from shardlab.deploy import slurm
            job_id = slurm.submit(_out(args) / slurm.SBATCH_NAME, list(args.sbatch_arg))
            print(f"submitted Slurm job {job_id}; log: {(_out(args) / 'logs').resolve()}/{args.job_name}-{job_id}.out")
            return 0
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise RenderError("kubectl is not on PATH")
        cmd = [kubectl, "apply", "-k", str(_out(args).resolve())]
        print(" ".join(cmd))
        return 0 if subprocess.run(cmd, timeout=120).returncode == 0 else 1
    except RenderError as e:
        print(f"shardlab submit {args.target}: {e}", file=sys.stderr)
        return 2 if not isinstance(e.__cause__, subprocess.SubprocessError) else 1
    except subprocess.TimeoutExpired as e:
        print(f"shardlab submit {args.target}: {e}", file=sys.stderr)
        return 1


def add_render_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("render", help="write Slurm / Kubernetes / accelerate files for a config",
                              description="Write ready-to-submit files for a config and print how to submit them.")
    targets = p.add_subparsers(dest="target", metavar="{slurm,k8s,accelerate}", required=True)
    for name, add in (("slurm", _add_slurm), ("k8s", _add_k8s), ("accelerate", _add_accelerate)):
        add(targets.add_parser(name, help=f"render for {name}"))
    p.set_defaults(func=cmd_render)
    return p


def add_submit_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("submit", help="render, then sbatch (slurm) or kubectl apply -k (k8s)",
                              description="Render the files, then submit them.")
    targets = p.add_subparsers(dest="target", metavar="{slurm,k8s}", required=True)
    s = targets.add_parser("slurm", help="render and sbatch")
    _add_slurm(s)
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch option, repeatable, e.g. --sbatch-arg=--dependency=afterok:123")
    _add_k8s(targets.add_parser("k8s", help="render and kubectl apply -k"))
    p.set_defaults(func=cmd_submit)
    return p
