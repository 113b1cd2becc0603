"""Static checks of the deploy files: Terraform structure, checkov, Kubernetes schemas,
yamllint, shellcheck. No cloud, no cluster, no terraform binary needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parents[1]
TF_DIR = ROOT / "infra" / "terraform" / "gcp"
CONFIG = str(ROOT / "configs" / "gpt-tiny.yaml")
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install -e '.[infra]'")
    return found


def run_cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "shardlab", *argv], check=True, timeout=120,
                   capture_output=True, text=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    """One rendered directory per target, shared by the checks below."""
    out = tmp_path_factory.mktemp("rendered")
    run_cli("render", "k8s", CONFIG, "--nodes", "2", "--gpus-per-node", "1", "--out", str(out / "k8s"),
            "--image", "us-central1-docker.pkg.dev/acme/shardlab/shardlab:0.1.0", "--bucket", "acme-shardlab-data")
    run_cli("render", "slurm", CONFIG, "train.global_batch_size=16", "--nodes", "2", "--gpus-per-node", "2",
            "--out", str(out / "slurm"), "--partition", "gpu")
    run_cli("render", "slurm", CONFIG, "--nodes", "2", "--gpus-per-node", "0", "--out", str(out / "slurm-cpu"))
    run_cli("render", "k8s", CONFIG, "--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "1",
            "--out", str(out / "k8s-elastic"))
    run_cli("render", "accelerate", CONFIG, "--nodes", "2", "--gpus-per-node", "2", "--out", str(out / "accelerate"))
    return out


# ------------------------------------------------------------------ Terraform

def norm(value):
    """Make the two `hcl2` modules' output alike: python-hcl2 and checkov's bc-python-hcl2 both
    install a module named `hcl2`; one wraps every attribute in a one-element list, newer
    versions keep the quotes of string literals."""
    if isinstance(value, list):
        return norm(value[0]) if len(value) == 1 else [norm(v) for v in value]
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


@pytest.fixture(scope="module")
def tf() -> dict:
    hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 not installed: pip install -e '.[infra]'")
    merged: dict[str, dict] = {"resource": {}, "variable": {}, "output": {}}
    for f in sorted(TF_DIR.glob("*.tf")):
        with open(f) as fh:
            doc = hcl2.load(fh)
        for block in doc.get("resource", []):
            for rtype, named in block.items():
                if rtype.startswith("__"):
                    continue
                for name, body in named.items():
                    if not name.startswith("__"):
                        merged["resource"][f"{rtype}.{name}"] = norm(body)
        for kind in ("variable", "output"):
            for block in doc.get(kind, []):
                merged[kind].update({k: norm(v) for k, v in block.items() if not k.startswith("__")})
    assert merged["resource"], "no Terraform resources parsed"
    return merged


def one(value):
    return value[0] if isinstance(value, list) else value


def test_terraform_t4_pool(tf):
    pool = tf["resource"]["google_container_node_pool.t4"]
    node = one(pool["node_config"])
    acc = one(node["guest_accelerator"])
    assert acc["type"] == "nvidia-tesla-t4"
    assert "gpus_per_node" in acc["count"]
    assert one(acc["gpu_driver_installation_config"])["gpu_driver_version"]
    assert "gpu_machine_type" in node["machine_type"]
    assert node["image_type"] == "COS_CONTAINERD"
    assert one(node["gvnic"])["enabled"] is True
    assert "gpu_spot" in node["spot"]
    taint = one(node["taint"])
    assert (taint["key"], taint["effect"]) == ("nvidia.com/gpu", "NO_SCHEDULE")
    auto = one(pool["autoscaling"])
    assert auto["min_node_count"] == 0 and "gpu_pool_max_nodes" in auto["max_node_count"]
    assert one(node["workload_metadata_config"])["mode"] == "GKE_METADATA"
    assert one(node["shielded_instance_config"])["enable_secure_boot"] is True
    assert "zone" in str(pool["node_locations"])


def test_terraform_machine_type_must_be_n1(tf):
    var = tf["variable"]["gpu_machine_type"]
    assert var["default"].startswith("n1-")
    assert "^n1-" in str(var["validation"])


def test_terraform_cluster(tf):
    c = tf["resource"]["google_container_cluster.this"]
    assert c["remove_default_node_pool"] is True
    assert c["networking_mode"] == "VPC_NATIVE"
    assert "svc.id.goog" in one(c["workload_identity_config"])["workload_pool"]
    assert one(c["private_cluster_config"])["enable_private_nodes"] is True
    assert one(one(c["addons_config"])["gcs_fuse_csi_driver_config"])["enabled"] is True
    assert one(one(c["master_auth"])["client_certificate_config"])["issue_client_certificate"] is False
    assert one(c["release_channel"])["channel"]
    assert "labels" in c["resource_labels"]
    assert "google_container_node_pool.system" in tf["resource"]


def test_terraform_network(tf):
    subnet = tf["resource"]["google_compute_subnetwork.nodes"]
    assert subnet["private_ip_google_access"] is True
    assert {r["range_name"] for r in subnet["secondary_ip_range"]} == {"pods", "services"}
    assert "google_compute_router_nat.nat" in tf["resource"]
    assert any(k.startswith("google_compute_firewall.") for k in tf["resource"])


def test_terraform_bucket_and_identity(tf):
    b = tf["resource"]["google_storage_bucket.data"]
    assert b["uniform_bucket_level_access"] is True
    assert b["public_access_prevention"] == "enforced"
    assert one(b["versioning"])["enabled"] is True
    binding = tf["resource"]["google_storage_bucket_iam_member.training"]
    assert binding["role"] == "roles/storage.objectUser"
    iam_text = (TF_DIR / "iam.tf").read_text()     # the principal is built in a `locals` block
    assert "/subject/ns/${var.k8s_namespace}/sa/${var.k8s_service_account}" in iam_text
    roles = tf["resource"]["google_project_iam_member.nodes"]["for_each"]
    assert "roles/container.defaultNodeServiceAccount" in str(roles)
    assert {"kubectl_credentials_command", "bucket_name"} <= set(tf["output"])


def test_terraform_fmt_if_terraform_is_installed():
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform binary not installed (not needed: the structure is checked with python-hcl2)")
    proc = subprocess.run([terraform, "fmt", "-check", "-recursive", str(TF_DIR)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"terraform fmt would change: {proc.stdout}"


# ------------------------------------------------------------------ checkov (one run for everything)

def test_checkov_no_failed_checks(rendered, tmp_path):
    checkov = tool("checkov")
    # checkov scans either directories or files in one run: gather copies in one tree
    tree = tmp_path / "scan"
    shutil.copytree(ROOT / "infra" / "terraform", tree / "terraform")
    (tree / "k8s").mkdir(parents=True)
    shutil.copy(rendered / "k8s" / "manifest.yaml", tree / "k8s" / "manifest.yaml")
    (tree / "docker").mkdir()
    shutil.copy(ROOT / "infra" / "docker" / "Dockerfile", tree / "docker" / "Dockerfile")
    cmd = [checkov, "--quiet", "--compact", "--skip-download", "--output", "json",
           "--framework", "terraform", "kubernetes", "dockerfile", "-d", str(tree)]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    seen, failed = set(), []
    for rep in reports:
        seen.add(rep.get("check_type"))
        for chk in rep.get("results", {}).get("failed_checks", []):
            failed.append(f"{chk['check_id']} {chk['resource']} {chk.get('file_path')}")
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert {"terraform", "kubernetes", "dockerfile"} <= seen, f"checkov scanned only {seen}"


# ------------------------------------------------------------------ Kubernetes schemas, YAML

def test_rendered_manifest_validates_against_kubernetes_schemas(rendered):
    kv = tool("kubernetes-validate")
    proc = subprocess.run([kv, "--strict", "-k", "1.30.0", str(rendered / "k8s" / "manifest.yaml"),
                           str(rendered / "k8s-elastic" / "manifest.yaml")],  # --min-nodes: the elastic Job
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job/" in proc.stdout and "service/" in proc.stdout


def test_infra_base_validates(tmp_path):
    from tests import kustomize_expand as kustomize

    objs = kustomize.build(kustomize.load_dir(ROOT / "infra" / "kubernetes"), "base")
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    kv = tool("kubernetes-validate")
    proc = subprocess.run([kv, "--strict", "-k", "1.30.0", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yamllint(rendered):
    yl = tool("yamllint")
    targets = [ROOT / "infra" / "kubernetes", rendered, ROOT / ".yamllint"]
    proc = subprocess.run([yl, "-s", "-c", str(ROOT / ".yamllint"), *map(str, targets)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


# ------------------------------------------------------------------ shellcheck

@pytest.fixture(scope="module")
def shellcheck() -> str:
    proc = subprocess.run(["bash", str(ROOT / "infra" / "apt-install.sh"), "shellcheck=shellcheck"],
                          capture_output=True, text=True, timeout=400)
    if proc.returncode == 3:
        pytest.skip(f"shellcheck cannot be installed here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return shutil.which("shellcheck") or pytest.skip("shellcheck not on PATH after install")


def test_shellcheck_scripts(rendered, shellcheck, tmp_path):
    scripts = [rendered / "slurm" / "shardlab.sbatch", rendered / "slurm-cpu" / "shardlab.sbatch",
               rendered / "accelerate" / "launch-accelerate.sh",
               ROOT / "infra" / "slurm" / "local-cluster.sh", ROOT / "infra" / "apt-install.sh"]
    # the pod's `sh -c` line too, as POSIX sh (the image's /bin/sh)
    job = next(d for d in yaml.safe_load_all((rendered / "k8s" / "manifest.yaml").read_text()) if d["kind"] == "Job")
    pod_script = tmp_path / "pod-command.sh"
    pod_script.write_text("#!/bin/sh\n" + job["spec"]["template"]["spec"]["containers"][0]["command"][-1])
    scripts.append(pod_script)
    proc = subprocess.run([shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout
