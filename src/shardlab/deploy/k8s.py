"""`shardlab render k8s`: an Indexed Job + headless Service for any Kubernetes cluster,
with the GKE pieces (T4 node selector, GCS FUSE bucket, workload identity) on top.

Why an Indexed Job: it is a core API (no operator to install), every pod gets a stable
hostname `<job>-<index>`, and with `subdomain: <service>` pod 0 is reachable as
`<job>-0.<service>`, which is where the torchrun agents meet (c10d rendezvous).

The manifests are built here as data, once. `infra/kubernetes/base` and the overlays in
`infra/kubernetes/overlays` are written by `python -m shardlab.deploy.k8s write-infra` from
the same functions with default values (a test keeps them in sync), and `render k8s`
writes a self-contained overlay: a copy of the base with the user's values, a
kustomization that adds the namespace, the image and the config as a ConfigMap, and the
same objects emitted directly in `manifest.yaml` for clusters applied without kustomize
(tests/kustomize_expand.py and `kubectl kustomize` check that both agree).

Preemption (docs/preemption.md): the agents are `python -m shardlab.torchrun` (torchrun that
exits 75 once its workers saved after a SIGTERM), `--shutdown-timeout` and the pod's
`terminationGracePeriodSeconds` come from the config's preemption grace, and the Job's
podFailurePolicy ignores both a `DisruptionTarget` pod (spot preemption, drain) and exit code
75, so the replacement pod resumes (checkpoint.resume=auto) without using up backoffLimit.
On GKE spot nodes the kubelet gives pods 15 s whatever the spec says (FIELD-NOTES).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from shardlab.deploy.common import (
    RESOLVED_CONFIG_NAME,
    DeployTarget,
    RenderError,
    add_min_nodes_argument,
    check_dns_label,
    check_every_size,
    check_positive,
    node_range,
    out_dir,
    resolve_config,
    sh_quote,
    with_defaults,
    write_files,
)
from shardlab.deploy.k8s_pod import (
    BUCKET_MOUNT,
    CONFIG_MOUNT,
    DEFAULT_IMAGE_TAG,
    GKE_SPOT_POD_GRACE_S,
    IMAGE_NAME,
    RDZV_PORT,
    K8sRequest,
    checkov_annotations,
    labels,
    pod_spec,
    pod_template,
    selector,
    torchrun_script,
)
from shardlab.loop import preemption


def job(req: K8sRequest) -> dict:
    rdzv_host = f"{req.name}-0.{req.service}"
    spec = pod_spec(req, ["/bin/sh", "-c", torchrun_script(req, rdzv_host)], subdomain=req.service)
    backoff = req.backoff_limit if req.backoff_limit is not None else req.nodes * (req.max_restarts + 1)
    out = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": req.name, "labels": labels(req), "annotations": checkov_annotations()},
        "spec": {
            "completionMode": "Indexed",
            "completions": req.nodes,
            "parallelism": req.nodes,
            "backoffLimit": backoff,
            "podFailurePolicy": {"rules": [
                # a spot preemption or node drain is not the job's fault: replace the pod for free
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # 75: a SIGTERM became a complete checkpoint (shardlab.loop.preemption); resume in a new pod
                {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                     "values": [preemption.PREEMPTED_EXIT_CODE]}},
            ]},
            "template": pod_template(req, spec),
        },
    }
    if req.min_nodes:
        del out["spec"]["backoffLimit"]  # per index instead
        out["spec"].update(_elastic_job_spec(req))
    return out


def _elastic_job_spec(req: K8sRequest) -> dict:
    """An elastic job's pods fail one index at a time: a pod whose index used up its retries
    (torch's agent restarts, then backoffLimitPerIndex replacement pods) fails that index only,
    while the others train on (torchrun --nnodes=MIN:MAX) as long as MIN are left; the Job
    succeeds once pod 0, which hosts the rendezvous (and must not be lost), succeeds."""
    lo, hi = node_range(req.min_nodes, req.nodes)
    return {"backoffLimitPerIndex": req.max_restarts + 1, "maxFailedIndexes": hi - lo,
            "successPolicy": {"rules": [{"succeededIndexes": "0"}]}}


def service(req: K8sRequest) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": req.service, "labels": labels(req)},
        "spec": {
            "clusterIP": "None",
            # pod 0 must resolve before it is Ready, or the rendezvous can never start
            "publishNotReadyAddresses": True,
            "selector": selector(req),
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def service_account(req: K8sRequest) -> dict:
    # Bound to the bucket by Terraform through workload identity federation (IAM on the
    # principal ns/<namespace>/sa/<name>), so it needs no annotation here.
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": req.service_account, "labels": labels(req)},
            "automountServiceAccountToken": False}


def network_policy(req: K8sRequest) -> dict:
    # Only the job's own pods may connect to it (rendezvous, NCCL/gloo). Egress stays open:
    # the bucket, the metadata server and the image registry are outside the namespace.
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{req.name}-peers", "labels": labels(req)},
        "spec": {"podSelector": {"matchLabels": selector(req)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": selector(req)}}]}]},
    }


def namespace(req: K8sRequest) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": req.namespace}}


BASE_FILES = ("serviceaccount.yaml", "service.yaml", "networkpolicy.yaml", "job.yaml")


def base_files(req: K8sRequest, config_yaml: str) -> dict[str, str]:
    """The kustomize base: the objects above, plus the config as a generated ConfigMap."""
    objs = {"serviceaccount.yaml": service_account(req), "service.yaml": service(req),
            "networkpolicy.yaml": network_policy(req), "job.yaml": job(req)}
    files = {name: dump(obj) for name, obj in objs.items()}
    files["config.yaml"] = config_yaml
    files["kustomization.yaml"] = dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": req.namespace,      # never `default`; an overlay's namespace replaces it
        "resources": list(BASE_FILES),
        "configMapGenerator": [{"name": req.config_map, "files": ["config.yaml"]}],
        # a fixed name: pods reference it, and a re-render should replace it, not add one
        "generatorOptions": {"disableNameSuffixHash": True},
    })
    return files


def manifest_objects(req: K8sRequest, config_yaml: str) -> list[dict]:
    """Every object of a rendered job, in its namespace, for `kubectl apply -f manifest.yaml`."""
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": req.config_map},
                  "data": {"config.yaml": config_yaml}}
    objs = [service_account(req), config_map, service(req), network_policy(req), job(req)]
    for obj in objs:
        obj["metadata"]["namespace"] = req.namespace
    return ([namespace(req)] if req.create_namespace else []) + objs


def split_image(image: str) -> tuple[str, dict[str, str]]:
    """`repo/name:tag` or `repo/name@sha256:...` -> (name, kustomize images fields)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, {"digest": digest}
    m = re.match(r"^(.*?)(?::([\w][\w.-]{0,127}))?$", image)
    assert m is not None
    name, tag = m.group(1), m.group(2)
    if "/" in (tag or ""):
        name, tag = image, None
    return name, ({"newTag": tag} if tag else {})


def overlay_files(req: K8sRequest, config_yaml: str) -> dict[str, str]:
    """What `render k8s` writes: base/ (with the user's values), the overlay kustomization,
    the resolved config (manifest.yaml is added by `render`)."""
    # the base keeps the default image name; the overlay's `images:` entry swaps in the user's
    # (so `kustomize edit set image shardlab=...` keeps working on the rendered directory)
    base_req = dataclasses.replace(req, image=f"{IMAGE_NAME}:{DEFAULT_IMAGE_TAG}")
    files = {f"base/{k}": v for k, v in base_files(base_req, "").items() if k != "config.yaml"}
    # the base's own generator is replaced by the overlay's, which carries the resolved config
    base_kust = yaml.safe_load(files["base/kustomization.yaml"])
    del base_kust["configMapGenerator"], base_kust["generatorOptions"]
    files["base/kustomization.yaml"] = dump(base_kust)
    new_name, image_fields = split_image(req.image)
    resources = (["namespace.yaml"] if req.create_namespace else []) + ["base"]
    kust = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": req.namespace,
        "resources": resources,
        "images": [{"name": IMAGE_NAME, "newName": new_name, **image_fields}],
        "configMapGenerator": [{"name": req.config_map, "files": [f"config.yaml={RESOLVED_CONFIG_NAME}"]}],
        "generatorOptions": {"disableNameSuffixHash": True},
    }
    if req.create_namespace:
        files["namespace.yaml"] = dump(namespace(req))
    files["kustomization.yaml"] = dump(kust)
    files[RESOLVED_CONFIG_NAME] = config_yaml
    return files


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap, the launch script) as `|` blocks,
    so they read like the files they are instead of one long escaped line."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def dump_all(objs: list[dict]) -> str:
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000,
                         explicit_start=True)


def k8s_overrides(req: K8sRequest, overrides: list[str]) -> list[str]:
    # checkpoints and outputs go to the bucket so they survive the pod; resume=auto so a
    # replaced pod (or a resubmitted job) continues from the newest complete checkpoint
    # the hang doctor's records land in <run dir>/debug on the bucket too (docs/debugging.md)
    return with_defaults(overrides, {
        "checkpoint.resume": "auto",
        "checkpoint.dir": f"{BUCKET_MOUNT}/checkpoints/{req.name}",
        "output.dir": f"{BUCKET_MOUNT}/runs",
        "doctor.enabled": "true",
    })


def check_request(req: K8sRequest) -> None:
    check_positive(req.nodes, "--nodes")
    check_positive(req.gpus_per_node, "--gpus-per-node", minimum=0)
    check_positive(req.max_restarts, "--max-restarts", minimum=0)
    node_range(req.min_nodes, req.nodes)
    # the job name becomes pod hostnames `<name>-<index>` (63 max) and label values
    check_dns_label(req.name, "--name", max_len=63 - 1 - len(str(req.nodes - 1)))
    check_dns_label(req.namespace, "--namespace")
    check_dns_label(req.service_account, "--service-account")
    if not re.match(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$", req.bucket):
        raise RenderError(f"--bucket {req.bucket!r} is not a valid Cloud Storage bucket name")
    if not req.image or any(c.isspace() for c in req.image):
        raise RenderError(f"--image {req.image!r} is not an image reference")


def render(req: K8sRequest) -> tuple[list[Path], str]:
    check_request(req)
    assert req.out is not None
    run = resolve_config(req.config, k8s_overrides(req, req.overrides), req.nodes * req.nproc)
    check_every_size(run, req.nproc, *node_range(req.min_nodes, req.nodes))
    grace = preemption.grace_estimate(run.config) if run.config.preemption.enabled else None
    if grace is not None:
        req = dataclasses.replace(req, grace_s=grace.grace_s)
    files = overlay_files(req, run.yaml_text)
    # the same objects the kustomization expands to, emitted directly (the tests check that
    # `kubectl kustomize` and an offline expansion of the written directory agree with it)
    files["manifest.yaml"] = dump_all(manifest_objects(req, run.yaml_text))
    out = req.out.resolve()
    written = write_files(out, files)
    hint = f"kubectl apply -k {sh_quote(str(out))}   # or: kubectl apply -f {sh_quote(str(out / 'manifest.yaml'))}"
    if grace is not None:
        hint += f"\n{grace.describe()}"
        if req.gpus_per_node and grace.grace_s > GKE_SPOT_POD_GRACE_S:
            hint += (f"\nnote: on GKE spot nodes pods get {GKE_SPOT_POD_GRACE_S} s after a preemption notice whatever "
                     f"terminationGracePeriodSeconds says; a save must fit in that (docs/preemption.md)")
    return written, hint


# ---------------------------------------------------------------- infra/kubernetes (write-infra)

def _pytorchjob_overlay(req: K8sRequest) -> dict[str, str]:
    # Kubeflow's training operator sets PET_* variables (nnodes, rdzv endpoint and id, max
    # restarts) from elasticPolicy, and torchrun reads them as defaults.
    spec = pod_spec(req, ["python", "-m", "shardlab.torchrun", f"--shutdown-timeout={req.grace_s}", "-m", "shardlab",
                          "train", f"{CONFIG_MOUNT}/config.yaml"], container_name="pytorch", restart_policy="OnFailure")
    spec["containers"][0]["env"] = [e for e in spec["containers"][0]["env"]
                                    if e["name"] not in ("JOB_UID", "POD_IP")]
    pj = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": req.name, "labels": labels(req), "annotations": checkov_annotations()},
        "spec": {
            "nprocPerNode": str(req.nproc),
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": req.nodes, "maxReplicas": req.nodes,
                              "maxRestarts": req.max_restarts},
            "pytorchReplicaSpecs": {"Worker": {"replicas": req.nodes, "restartPolicy": "OnFailure",
                                               "template": pod_template(req, spec)}},
        },
    }
    return {"pytorchjob.yaml": dump(pj), "kustomization.yaml": dump(_replace_job_kustomization(req, "pytorchjob.yaml"))}


def _jobset_overlay(req: K8sRequest) -> dict[str, str]:
    # JobSet names pods <jobset>-<replicatedJob>-<jobIndex>-<podIndex> under the subdomain
    # <jobset>; pod 0 of job 0 hosts the rendezvous.
    rdzv_host = f"{req.name}-workers-0-0.{req.name}"
    spec = pod_spec(req, ["/bin/sh", "-c", torchrun_script(req, rdzv_host)])
    js = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": req.name, "labels": labels(req), "annotations": checkov_annotations()},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": req.max_restarts},
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
                "completionMode": "Indexed", "completions": req.nodes, "parallelism": req.nodes,
                "backoffLimit": 0,
                "template": pod_template(req, spec)}}}],
        },
    }
    return {"jobset.yaml": dump(js), "kustomization.yaml": dump(_replace_job_kustomization(req, "jobset.yaml"))}


def _replace_job_kustomization(req: K8sRequest, new_resource: str) -> dict:
    # Both controllers create their own headless Service, so the base's Job and Service go.
    deletes = [{"patch": dump({"$patch": "delete", "apiVersion": api, "kind": kind,
                                "metadata": {"name": name}})}
               for api, kind, name in (("batch/v1", "Job", req.name), ("v1", "Service", req.service))]
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["../../base", new_resource], "patches": deletes}


def infra_files(config_yaml: str) -> dict[str, str]:
    """infra/kubernetes: base with default values (2 T4 nodes x 1 GPU) and the two overlays."""
    req = K8sRequest(config=None, overrides=[], nodes=2, gpus_per_node=1, grace_s=default_infra_grace_s())
    files = {f"base/{k}": v for k, v in base_files(req, config_yaml).items()}
    files.update({f"overlays/pytorchjob/{k}": v for k, v in _pytorchjob_overlay(req).items()})
    files.update({f"overlays/jobset/{k}": v for k, v in _jobset_overlay(req).items()})
    return files


DEFAULT_INFRA_CONFIG = "configs/gpt-tiny.yaml"


def default_infra_grace_s() -> int:
    req = K8sRequest(config=None, overrides=[], nodes=2, gpus_per_node=1)
    cfg = resolve_config(DEFAULT_INFRA_CONFIG, k8s_overrides(req, []), req.nodes * req.nproc).config
    return preemption.grace_estimate(cfg).grace_s


def default_infra_config_yaml() -> str:
    req = K8sRequest(config=None, overrides=[], nodes=2, gpus_per_node=1)
    return resolve_config(DEFAULT_INFRA_CONFIG, k8s_overrides(req, []), req.nodes * req.nproc).yaml_text


# -- the command (shardlab render/submit k8s) -------------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_min_nodes_argument(p)


def _render_args(args: argparse.Namespace, common: dict) -> tuple[list[Path], str]:
    return render(K8sRequest(
        **common, name=args.name, namespace=args.namespace, image=args.image, bucket=args.bucket,
        service_account=args.service_account, accelerator=args.accelerator, cpu_per_node=args.cpu_per_node,
        memory_per_node=args.memory_per_node, shm_size=args.shm_size, max_restarts=args.max_restarts,
        create_namespace=args.create_namespace, min_nodes=args.min_nodes))


def _submit_args(args: argparse.Namespace, out: Path) -> int:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RenderError("kubectl is not on PATH")
    cmd = [kubectl, "apply", "-k", str(out_dir(args).resolve())]
    print(" ".join(cmd))
    return 0 if subprocess.run(cmd, timeout=120).returncode == 0 else 1


TARGET = DeployTarget("k8s", "an Indexed Job + headless Service (kustomize base and overlays)", _add_arguments,
                      _render_args, submit=_submit_args)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardlab.deploy.k8s")
    p.add_argument("command", choices=["write-infra"])
    p.add_argument("--dir", default="infra/kubernetes")
    args = p.parse_args(argv)
    out = Path(args.dir)
    for path in write_files(out, infra_files(default_infra_config_yaml())):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
