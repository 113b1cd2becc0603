"""The subset of kustomize that shardlab's own overlays use, in Python, for the tests.

`render k8s` writes both a kustomization and `manifest.yaml` (the objects emitted directly);
this expansion checks that the two say the same thing, and lets the tests validate the
infra/kubernetes overlays on machines without kubectl.
Supported: `resources` (files and directories), `namespace`, `images`,
`configMapGenerator` with `files` (hash suffix disabled), and `patches` that delete an
object (`$patch: delete`). Anything else raises, so a kustomization that grows a feature
this file does not know cannot be expanded silently wrong; the tests compare the result
with `kubectl kustomize` where kubectl is installed.
"""

from __future__ import annotations

import copy
import posixpath
from pathlib import Path

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "configMapGenerator",
                  "generatorOptions", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# kustomize's legacy output order for the kinds we emit; the rest keep their input order
KIND_ORDER = ["Namespace", "ServiceAccount", "ConfigMap", "Service"]


class KustomizeError(ValueError):
    pass


def load_dir(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


def build(files: dict[str, str], path: str = ".") -> list[dict]:
    """Expand the kustomization at `path` inside `files` (relative path -> text)."""
    objs = _build(files, posixpath.normpath(path))
    return sorted(objs, key=lambda o: KIND_ORDER.index(o["kind"]) if o["kind"] in KIND_ORDER
                  else len(KIND_ORDER))


def _read(files: dict[str, str], path: str) -> str:
    path = posixpath.normpath(path)
    if path not in files:
        raise KustomizeError(f"{path}: not found")
    return files[path]


def _build(files: dict[str, str], d: str) -> list[dict]:
    kust = yaml.safe_load(_read(files, posixpath.join(d, "kustomization.yaml")))
    unknown = set(kust) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{d}/kustomization.yaml: unsupported keys {sorted(unknown)}")
    objs: list[dict] = []
    for res in kust.get("resources", []):
        rp = posixpath.normpath(posixpath.join(d, res))
        if posixpath.join(rp, "kustomization.yaml") in files:
            objs.extend(_build(files, rp))
        else:
            objs.extend(o for o in yaml.safe_load_all(_read(files, rp)) if o)
    gen_opts = kust.get("generatorOptions", {})
    for gen in kust.get("configMapGenerator", []):
        if not gen_opts.get("disableNameSuffixHash"):
            raise KustomizeError("configMapGenerator needs generatorOptions.disableNameSuffixHash: true here")
        if set(gen) - {"name", "files"}:
            raise KustomizeError(f"configMapGenerator: unsupported keys {sorted(set(gen) - {'name', 'files'})}")
        data = {}
        for entry in gen["files"]:
            key, _, src = entry.partition("=") if "=" in entry else (posixpath.basename(entry), "", entry)
            data[key] = _read(files, posixpath.join(d, src))
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in kust.get("patches", []):
        body = yaml.safe_load(patch["patch"]) if "patch" in patch else None
        if set(patch) != {"patch"} or not isinstance(body, dict) or body.get("$patch") != "delete":
            raise KustomizeError("only `$patch: delete` patches are supported here")
        objs = [o for o in objs if not (o["kind"] == body["kind"] and o["metadata"]["name"] == body["metadata"]["name"])]
    if "namespace" in kust:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = kust["namespace"]
    for img in kust.get("images", []):
        for o in objs:
            for c in _containers(o):
                c["image"] = _retag(c["image"], img)
    return [copy.deepcopy(o) for o in objs]


def _containers(obj: dict):
    """Every container list in the object, wherever a pod template sits."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    yield from value
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _retag(image: str, rule: dict) -> str:
    if "@" in image:
        name = image.split("@", 1)[0]
    else:
        last = image.rsplit("/", 1)[-1]
        name = image[: len(image) - len(last)] + last.split(":", 1)[0]
    if name != rule["name"]:
        return image
    new = rule.get("newName", name)
    if "digest" in rule:
        return f"{new}@{rule['digest']}"
    if "newTag" in rule:
        return f"{new}:{rule['newTag']}"
    return new + image[len(name):]
