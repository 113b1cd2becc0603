"""The pod of `shardlab render k8s` (deploy/k8s.py): the request (`K8sRequest`), the pod every
variant runs (`pod_spec`: the Indexed Job's, a PyTorchJob worker's, a JobSet replica's), its labels
and the torchrun line its agent runs. The objects around it (Job, Service, policies, kustomize
files) and the command are deploy/k8s.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shardlab.deploy.common import node_range

IMAGE_NAME = "shardlab"             # the name the kustomization's `images:` entry rewrites
DEFAULT_IMAGE_TAG = "0.1.0"
RUN_AS_UID = 10001                 # the Dockerfile's user; > 10000 so it never maps to a host user
BUCKET_MOUNT = "/mnt/shardlab"
CONFIG_MOUNT = "/etc/shardlab"
RDZV_PORT = 29500
GPU_RESOURCE = "nvidia.com/gpu"
GKE_SPOT_POD_GRACE_S = 15          # graceful node shutdown's default share for pods on spot VMs
AGENT_EXIT_S = 5                   # after the workers: the agent's own exit

# Checkov findings that do not fit a training pod, skipped in place with the reason.
CHECKOV_SKIPS = {
    "CKV_K8S_11": "no CPU limit on purpose: CFS throttling stalls data loaders and collective timeouts",
    "CKV_K8S_43": "the image is pinned by tag per release; pass --image NAME@sha256:... to pin a digest",
}


@dataclass
class K8sRequest:
    config: str | None
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    out: Path | None = None
    name: str = "shardlab-train"
    namespace: str = "shardlab"
    image: str = f"{IMAGE_NAME}:{DEFAULT_IMAGE_TAG}"
    bucket: str = "shardlab-data"
    service_account: str = "shardlab-trainer"
    accelerator: str = "nvidia-tesla-t4"
    cpu_per_node: str = "4"
    memory_per_node: str = "16Gi"
    shm_size: str = "8Gi"
    max_restarts: int = 3
    backoff_limit: int | None = None      # default: nodes * (max_restarts + 1)
    create_namespace: bool = True
    extra_labels: dict[str, str] = field(default_factory=dict)
    grace_s: int = 30                     # preemption grace (render fills it from the config)
    min_nodes: int | None = None          # elastic: torchrun --nnodes=MIN:NODES (docs/elastic.md)

    @property
    def nproc(self) -> int:
        return max(self.gpus_per_node, 1)

    @property
    def service(self) -> str:
        return self.name      # one headless Service per job, named like it

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"


def labels(req: K8sRequest) -> dict[str, str]:
    return {"app.kubernetes.io/name": "shardlab", "app.kubernetes.io/instance": req.name,
            "app.kubernetes.io/component": "trainer", **req.extra_labels}


def selector(req: K8sRequest) -> dict[str, str]:
    return {"app.kubernetes.io/name": "shardlab", "app.kubernetes.io/instance": req.name}


def torchrun_script(req: K8sRequest, rdzv_host: str) -> str:
    # A shell line because pod 0 must be told it hosts the rendezvous store: guessing it from
    # DNS fails while its own record is not yet published, and then nobody serves the store.
    parts = [
        "exec python -m shardlab.torchrun",
        "--nnodes={}:{}".format(*node_range(req.min_nodes, req.nodes)) if req.min_nodes else f"--nnodes={req.nodes}",
        f"--nproc-per-node={req.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{RDZV_PORT}",
        '--rdzv-id="$JOB_UID"',
        '--rdzv-conf="is_host=$([ "$JOB_COMPLETION_INDEX" = 0 ] && echo 1 || echo 0)"',
        '--local-addr="$POD_IP"',
        f"--max-restarts={req.max_restarts}",
        f"--shutdown-timeout={req.grace_s}",
        f"-m shardlab train {CONFIG_MOUNT}/config.yaml",
    ]
    return " \\\n  ".join(parts) + "\n"


def container(req: K8sRequest, command: list[str] | None, name: str) -> dict:
    """The trainer container: its environment, resources, locked-down security context and mounts."""
    resources: dict = {"requests": {"cpu": req.cpu_per_node, "memory": req.memory_per_node},
                       "limits": {"memory": req.memory_per_node}}
    if req.gpus_per_node:
        # extended resources: request must equal limit, so set both
        resources["requests"][GPU_RESOURCE] = req.gpus_per_node
        resources["limits"][GPU_RESOURCE] = req.gpus_per_node
    out: dict = {
        "name": name,
        "image": req.image,
        "imagePullPolicy": "Always",
        "env": [
            {"name": "JOB_UID", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # N1 + T4 has no RDMA: NCCL and gloo both go over TCP on the pod interface.
            {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
            {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
            {"name": "OMP_NUM_THREADS", "value": str(max(1, int(float(req.cpu_per_node)) // req.nproc))},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            # the root filesystem is read-only: caches (torch, triton, HF) go to the /tmp volume
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "bucket", "mountPath": BUCKET_MOUNT},
        ],
    }
    if command is not None:
        out["command"] = command
    return out


def pod_spec(req: K8sRequest, command: list[str] | None, container_name: str = "trainer",
             subdomain: str | None = None, restart_policy: str = "Never") -> dict:
    """The pod every variant runs (Indexed Job, PyTorchJob worker, JobSet replica): the trainer
    container, non-root, with its shared memory, scratch, config and bucket volumes."""
    spec: dict = {
        "restartPolicy": restart_policy,
        # SIGTERM -> the workers save at their next step boundary; then SIGKILL (docs/preemption.md)
        "terminationGracePeriodSeconds": req.grace_s + AGENT_EXIT_S,
        "serviceAccountName": req.service_account,
        # nothing in the pod talks to the API server; the GCS FUSE driver gets its own token
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "fsGroup": RUN_AS_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container(req, command, container_name)],
        "volumes": [
            # the default 64 MiB /dev/shm is too small for data-loader workers and NCCL
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": req.shm_size}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "config", "configMap": {"name": req.config_map}},
            # checkpoints and data outlive the pod: they live in the bucket, not in an emptyDir
            {"name": "bucket", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {
                "bucketName": req.bucket,
                "mountOptions": f"implicit-dirs,uid={RUN_AS_UID},gid={RUN_AS_UID}"}}},
        ],
    }
    if subdomain:
        spec["subdomain"] = subdomain
    if req.gpus_per_node:
        spec["nodeSelector"] = {"cloud.google.com/gke-accelerator": req.accelerator}
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def pod_template(req: K8sRequest, spec: dict) -> dict:
    return {"metadata": {"labels": labels(req), "annotations": {"gke-gcsfuse/volumes": "true"}},
            "spec": spec}


def checkov_annotations() -> dict[str, str]:
    return {f"checkov.io/skip{i}": f"{check}={reason}"
            for i, (check, reason) in enumerate(CHECKOV_SKIPS.items(), start=1)}
