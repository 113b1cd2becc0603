"""`shardlab render`: what each target writes, and that bad requests write nothing."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shardlab.deploy import RenderError, add_render_parser, add_submit_parser, k8s
from tests import kustomize_expand as kustomize

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "gpt-tiny.yaml")


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="shardlab")
    sub = parser.add_subparsers(dest="command", required=True)
    add_render_parser(sub)
    add_submit_parser(sub)
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_slurm_sbatch_layout(tmp_path):
    out = tmp_path / "slurm"
    assert cli("render", "slurm", CONFIG, "train.steps=7", "train.global_batch_size=32", "--nodes", "4", "--gpus-per-node", "2",
               "--partition", "gpu", "--account", "proj", "--max-restarts", "5", "--out", str(out)) == 0
    text = (out / "shardlab.sbatch").read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --cpus-per-task=8",
                 "--nproc-per-node=2", '--rdzv-id="$RDZV_ID"', "--rdzv-backend=c10d",
                 '--rdzv-endpoint="$HEAD_HOST:$RDZV_PORT"', "--max-restarts=5",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1', "NCCL_SOCKET_IFNAME",
                 f"#SBATCH --output={out.resolve()}/logs/%x-%j.out"):
        assert line in text, line
    assert (out / "logs").is_dir()
    resolved = yaml.safe_load((out / "shardlab-config.yaml").read_text())
    assert resolved["train"]["steps"] == 7
    assert resolved["checkpoint"]["resume"] == "auto"       # restarts continue from a checkpoint
    assert str((out / "shardlab-config.yaml").resolve()) in text


def test_slurm_cpu_run_requests_no_gpu(tmp_path):
    assert cli("render", "slurm", CONFIG, "--nodes", "2", "--gpus-per-node", "0", "--out", str(tmp_path)) == 0
    text = (tmp_path / "shardlab.sbatch").read_text()
    assert "gpus" not in text.replace("--gpus-per-node 0", "")
    assert "--nproc-per-node=1" in text


def test_user_resume_choice_wins(tmp_path):
    assert cli("render", "slurm", CONFIG, "checkpoint.resume=none", "--nodes", "2", "--out", str(tmp_path)) == 0
    assert yaml.safe_load((tmp_path / "shardlab-config.yaml").read_text())["checkpoint"]["resume"] == "none"


@pytest.mark.parametrize("target,argv,message", [
    ("slurm", ["no.such_key=1"], "no.such_key"),
    ("slurm", ["--nodes", "3"], "has no layout at world size 3"),           # 16 samples over 3 ranks
    ("slurm", ["--nodes", "0"], "--nodes"),
    ("slurm", ["--gpus-per-node", "-1"], "--gpus-per-node"),
    ("k8s", ["--nodes", "0"], "--nodes"),
    ("k8s", ["--name", "Bad_Name"], "--name"),
    ("k8s", ["--bucket", "UPPER"], "--bucket"),
    ("k8s", ["--nodes", "3"], "has no layout at world size 3"),
    # elastic: 1 <= MIN <= MAX, and a layout at every size between (3 nodes of 1 rank: 16 samples)
    ("slurm", ["--nodes", "2", "--min-nodes", "3"], "--min-nodes 3: needs 1 <= --min-nodes <= --nodes (2)"),
    ("k8s", ["--nodes", "2", "--min-nodes", "0"], "--min-nodes 0: needs 1"),
    ("slurm", ["--nodes", "4", "--min-nodes", "1", "--gpus-per-node", "0"], "at 3 node(s), train.global_batch_size=16 "
                                                                            "has no layout at world size 3"),
    ("k8s", ["--nodes", "4", "--min-nodes", "2"], "at 3 node(s)"),
    ("accelerate", ["--gpus-per-node", "0"], "--gpus-per-node"),
    ("accelerate", ["--layer-cls", "not a class"], "--layer-cls"),
])
def test_bad_request_writes_nothing(tmp_path, capsys, target, argv, message):
    out = tmp_path / "out"
    assert cli("render", target, CONFIG, *argv, "--out", str(out)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_elastic_form(tmp_path):
    """--min-nodes: torchrun --nnodes=MIN:MAX in both; Slurm keeps the job and the step when a node
    or task is lost; the k8s Job fails per index, at most MAX - MIN of them, and succeeds with pod 0."""
    assert cli("render", "slurm", CONFIG, "train.global_batch_size=24", "--nodes", "4", "--min-nodes", "2",
               "--out", str(tmp_path / "s")) == 0  # 24 samples: a layout at 2, 3 and 4 ranks
    sbatch = (tmp_path / "s" / "shardlab.sbatch").read_text()
    assert "#SBATCH --no-kill" in sbatch and "srun --no-kill" in sbatch and "srun --kill-on-bad-exit" not in sbatch
    assert '--nnodes="2:$NUM_AGENTS"' in sbatch and "2..4 node(s) (elastic)" in sbatch
    assert cli("render", "k8s", CONFIG, "train.global_batch_size=24", "--nodes", "4", "--min-nodes", "2",
               "--out", str(tmp_path / "k")) == 0
    job = next(o for o in yaml.safe_load_all((tmp_path / "k" / "manifest.yaml").read_text()) if o["kind"] == "Job")
    assert "--nnodes=2:4" in job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "backoffLimit" not in job["spec"]
    assert (job["spec"]["backoffLimitPerIndex"], job["spec"]["maxFailedIndexes"]) == (4, 2)  # 3 restarts + 1
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}


def test_missing_config_file(tmp_path, capsys):
    assert cli("render", "slurm", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")) == 2
    assert "does not exist" in capsys.readouterr().err


def render_k8s(out: Path, *extra: str) -> list[dict]:
    assert cli("render", "k8s", CONFIG, "--nodes", "2", "--gpus-per-node", "1", "--out", str(out), *extra) == 0
    return [d for d in yaml.safe_load_all((out / "manifest.yaml").read_text()) if d]


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_k8s_indexed_job_and_headless_service(tmp_path):
    objs = by_kind(render_k8s(tmp_path / "k", "--name", "gpt-run", "--namespace", "ml", "--bucket", "acme-ckpt",
                              "--image", "europe-docker.pkg.dev/acme/ml/shardlab:1.2.3"))
    job, svc = objs["Job"], objs["Service"]
    assert {o["metadata"].get("namespace") for k, o in objs.items() if k != "Namespace"} == {"ml"}
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "Ignore" and rule["onPodConditions"][0]["type"] == "DisruptionTarget"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "gpt-run"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    script = pod["containers"][0]["command"][-1]
    assert "--rdzv-endpoint=gpt-run-0.gpt-run:29500" in script and "--rdzv-backend=c10d" in script
    c = pod["containers"][0]
    assert c["image"] == "europe-docker.pkg.dev/acme/ml/shardlab:1.2.3"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["bucket"]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert vols["bucket"]["csi"]["volumeAttributes"]["bucketName"] == "acme-ckpt"
    assert job["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    cfg = yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"])
    assert cfg["checkpoint"]["dir"].startswith("/mnt/shardlab/") and cfg["checkpoint"]["resume"] == "auto"


def test_k8s_cpu_only_has_no_gpu_scheduling(tmp_path):
    pod = by_kind(render_k8s(tmp_path / "k", "--gpus-per-node", "0"))["Job"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]


def test_k8s_image_digest(tmp_path):
    objs = by_kind(render_k8s(tmp_path / "k", "--image", "reg.example/x/shardlab@sha256:" + "a" * 64))
    assert objs["Job"]["spec"]["template"]["spec"]["containers"][0]["image"].endswith("@sha256:" + "a" * 64)


def _canonical(objs: list[dict]) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_manifest_equals_the_expanded_kustomization(tmp_path):
    """manifest.yaml is emitted directly; the kustomization beside it must expand to the same."""
    for extra in ([], ["--no-namespace-object"]):
        out = tmp_path / f"k{len(extra)}"
        ours = render_k8s(out, "--namespace", "team-a", "--image", "reg.example/x/shardlab:9", *extra)
        expanded = kustomize.build(kustomize.load_dir(out))
        assert _canonical(ours) == _canonical(expanded)
        assert [o["kind"] for o in ours][:1] == (["ServiceAccount"] if extra else ["Namespace"])


@pytest.mark.infra
def test_python_expansion_matches_kubectl_kustomize(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (not in Debian's archive); the Python expansion is checked by schema tests")
    out = tmp_path / "k"
    ours = render_k8s(out, "--namespace", "team-a", "--image", "reg.example/x/shardlab:9")
    theirs = yaml.safe_load_all(subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True,
                                               check=True, timeout=60).stdout)
    assert _canonical(ours) == _canonical([d for d in theirs if d])
    for overlay in ("base", "overlays/pytorchjob", "overlays/jobset"):
        d = ROOT / "infra" / "kubernetes" / overlay
        theirs = subprocess.run([kubectl, "kustomize", str(d)], capture_output=True, text=True, check=True,
                                timeout=60).stdout
        ours = kustomize.build(kustomize.load_dir(ROOT / "infra" / "kubernetes"), overlay)
        assert _canonical(ours) == _canonical([x for x in yaml.safe_load_all(theirs) if x]), overlay


def test_infra_kubernetes_is_in_sync_with_renderer():
    """infra/kubernetes is generated; edit k8s.py and run `python -m shardlab.deploy.k8s write-infra`."""
    expected = k8s.infra_files(k8s.default_infra_config_yaml())
    root = ROOT / "infra" / "kubernetes"
    for rel, text in expected.items():
        assert (root / rel).read_text() == text, f"{rel} is stale: run python -m shardlab.deploy.k8s write-infra"


def test_accelerate_fsdp2_config(tmp_path):
    out = tmp_path / "acc"
    assert cli("render", "accelerate", CONFIG, "--nodes", "2", "--gpus-per-node", "2",
               "--main-process-ip", "10.0.0.2", "--out", str(out)) == 0
    cfg = yaml.safe_load((out / "accelerate-fsdp.yaml").read_text())
    fsdp = cfg["fsdp_config"]
    assert cfg["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert cfg["mixed_precision"] == "fp16"          # T4 default
    assert (cfg["num_machines"], cfg["num_processes"], cfg["main_process_ip"]) == (2, 4, "10.0.0.2")
    assert (out / "shardlab-config.yaml").exists()
    script = (out / "launch-accelerate.sh").read_text()
    assert 'shardlab-config.yaml' in script and '"$@"' in script and "--machine_rank" in script


def test_accelerate_bf16_and_hf_layer(tmp_path):
    assert cli("render", "accelerate", CONFIG, "--gpus-per-node", "4", "--mixed-precision", "bf16",
               "--layer-cls", "LlamaDecoderLayer", "--out", str(tmp_path)) == 0
    cfg = yaml.safe_load((tmp_path / "accelerate-fsdp.yaml").read_text())
    assert cfg["mixed_precision"] == "bf16"
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"


def test_accelerate_wraps_the_units_shardlab_wraps(tmp_path):
    """The layer class the accelerate config names by default is the class of the units shardlab's
    own engines wrap in the config's model (its repeated blocks), and of nothing else in it."""
    from shardlab.config import load_config
    from shardlab.models import build_model, repeated_blocks

    assert cli("render", "accelerate", CONFIG, "--gpus-per-node", "2", "--out", str(tmp_path)) == 0
    named = yaml.safe_load((tmp_path / "accelerate-fsdp.yaml").read_text())["fsdp_config"][
        "fsdp_transformer_layer_cls_to_wrap"]
    model = build_model(load_config(CONFIG, []).model, vocab_size=256, device="meta")
    units = repeated_blocks(model)
    assert len(units) == model.config.n_layer
    assert [m for m in model.modules() if type(m).__name__ == named] == units, named


def test_submit_slurm_without_sbatch_fails_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))       # no sbatch anywhere
    assert cli("submit", "slurm", CONFIG, "--out", str(tmp_path / "o")) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err


def test_unknown_deploy_target_is_an_error(capsys):
    """Every target comes from the registry (shardlab.deploy.DEPLOY_TARGETS); an unknown one is
    refused with the valid names, where it used to fall through to accelerate."""
    from shardlab.deploy import DEPLOY_TARGETS, cmd_render, deploy_target

    with pytest.raises(RenderError, match="unknown deploy target 'nomad'; valid: slurm, k8s, accelerate"):
        deploy_target("nomad")
    assert cmd_render(argparse.Namespace(target="nomad", config="configs/gpt-tiny.yaml", overrides=[], nodes=1,
                                         gpus_per_node=1, out=None)) == 2
    assert "unknown deploy target" in capsys.readouterr().err
    assert all(deploy_target(name).name == name for name in DEPLOY_TARGETS)
