"""Offline checks of the Nebius cluster in infra/terraform/nebius: Terraform structure
(python-hcl2), variable validation and template rendering with a real terraform binary when
one is installed (no provider is downloaded: only variables, locals and outputs are evaluated),
checkov with the module's own Nebius policies, shellcheck, a cloud-init that names nothing
outside the repository, and the per-node launcher running a two-agent job on this host."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parents[1]
TF_DIR = ROOT / "infra" / "terraform" / "nebius"
SCRIPTS = TF_DIR / "scripts"
TEMPLATE = TF_DIR / "cloud-init.yaml.tftpl"
LAUNCH = SCRIPTS / "shardlab-launch.sh"
NODE_SETUP = SCRIPTS / "node-setup.sh"
BIN = Path(sys.executable).parent

SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOnlyForTestsOnlyForTestsOnlyForTestsOnly0 test@example"
# the variables without defaults, as a user's terraform.tfvars would set them
REQUIRED_VARS = {
    "project_id": "project-e00test123",
    "ssh_allowed_cidrs": ["203.0.113.7/32"],
    "ssh_public_keys": [SSH_KEY],
}


# ------------------------------------------------------------------ parsing

def norm(value):
    """python-hcl2 and checkov's bc-python-hcl2 both install a module named `hcl2`; one wraps
    attributes in one-element lists, newer versions keep the quotes of string literals."""
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
    merged: dict[str, dict] = {"resource": {}, "variable": {}, "output": {}, "locals": {}, "check": {}}
    for f in sorted(TF_DIR.glob("*.tf")):
        with open(f) as fh:
            doc = hcl2.load(fh)
        for block in doc.get("resource", []):
            for rtype, named in block.items():
                for name, body in named.items():
                    if not rtype.startswith("__") and not name.startswith("__"):
                        merged["resource"][f"{rtype}.{name}"] = norm(body)
        for kind in ("variable", "output", "check"):
            for block in doc.get(kind, []):
                merged[kind].update({k: norm(v) for k, v in block.items() if not k.startswith("__")})
        for block in doc.get("locals", []):
            merged["locals"].update({k: norm(v) for k, v in block.items() if not k.startswith("__")})
    assert merged["resource"], "no Terraform resources parsed"
    return merged


def squash(value) -> str:
    """An expression without whitespace (hcl2 versions differ in the spaces they keep)."""
    return re.sub(r"\s+", "", str(value))


def variable_blocks_removed(text: str) -> str:
    """The .tf text without its `variable` blocks (defaults are where literals belong)."""
    out, depth, skipping = [], 0, False
    for line in text.splitlines():
        if not skipping and re.match(r'^variable\s+"', line):
            skipping, depth = True, 0
        if skipping:
            depth += line.count("{") - line.count("}")
            if depth <= 0 and "}" in line:
                skipping = False
            continue
        out.append(line)
    return "\n".join(out)


# ------------------------------------------------------------------ variables and literals

def test_every_free_form_variable_is_validated(tf):
    variables = tf["variable"]
    assert len(variables) >= 25
    unvalidated = {"labels", "public_ip_all_nodes", "preemptible", "filesystem_forbid_deletion"}  # maps and bools
    for name, var in variables.items():
        assert var.get("description"), f"variable {name} has no description"
        assert var.get("type"), f"variable {name} has no type"
        if name not in unvalidated:
            assert "validation" in var, f"variable {name} takes any value: add a validation block"


def test_no_hard_coded_addresses_or_ids_outside_variables():
    ipv4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?(?![\w.])")
    nebius_id = re.compile(r"\b(?:project|vpc[a-z]*|compute[a-z]*|serviceaccount)-e00[a-z0-9]+\b")
    for f in sorted(TF_DIR.glob("*.tf")):
        text = variable_blocks_removed(f.read_text())
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())    # comments may give examples
        assert not ipv4.findall(code), f"{f.name}: address literal outside a variable: {ipv4.findall(code)}"
        assert not nebius_id.findall(code), f"{f.name}: Nebius ID literal: {nebius_id.findall(code)}"


def test_every_resource_lives_in_the_project_variable(tf):
    for key, body in tf["resource"].items():
        parent = body["parent_id"]
        if key.startswith("nebius_vpc_v1_security_rule."):
            assert parent == "${nebius_vpc_v1_security_group.nodes.id}", key   # a rule's parent is its group
        else:
            assert parent == "${var.project_id}", key
        assert "var.labels" in str(body.get("labels")), f"{key} carries no labels"


def test_network_ranges_come_from_validated_variables(tf):
    res, variables = tf["resource"], tf["variable"]
    pool = res["nebius_vpc_v1_pool.private"]
    assert (pool["version"], pool["visibility"]) == ("IPV4", "PRIVATE")
    assert "var.network_cidr" in str(pool["cidrs"])
    net = res["nebius_vpc_v1_network.this"]
    assert "nebius_vpc_v1_pool.private.id" in str(net["ipv4_private_pools"])
    subnet = res["nebius_vpc_v1_subnet.nodes"]
    assert subnet["network_id"] == "${nebius_vpc_v1_network.this.id}"
    pools = subnet["ipv4_private_pools"]
    assert pools["use_network_pools"] is False and "var.subnet_cidr" in str(pools["pools"])
    # the subnet-inside-network rule is a validation, so a bad pair fails at plan time
    assert "var.network_cidr" in str(variables["subnet_cidr"]["validation"])
    alloc = res["nebius_vpc_v1_allocation.node"]
    assert alloc["count"] == "${var.node_count}"
    assert alloc["ipv4_private"]["subnet_id"] == "${nebius_vpc_v1_subnet.nodes.id}"


def test_firewall_rules(tf):
    res = tf["resource"]
    rules = {k.split(".", 1)[1]: v for k, v in res.items() if k.startswith("nebius_vpc_v1_security_rule.")}
    assert set(rules) == {"intra_cluster", "intra_cluster_egress", "ssh", "egress"}
    assert all(r["access"] == "ALLOW" for r in rules.values())
    assert rules["intra_cluster"]["ingress"]["source_security_group_id"] == "${nebius_vpc_v1_security_group.nodes.id}"
    assert rules["intra_cluster_egress"]["egress"]["destination_security_group_id"] == \
        "${nebius_vpc_v1_security_group.nodes.id}"
    ssh = rules["ssh"]
    assert (ssh["protocol"], ssh["ingress"]["destination_ports"]) == ("TCP", 22)
    assert ssh["ingress"]["source_cidrs"] == "${var.ssh_allowed_cidrs}"
    assert "default" not in tf["variable"]["ssh_allowed_cidrs"]          # the user must choose
    assert rules["egress"]["egress"]["destination_cidrs"] == "${var.egress_cidrs}"


def test_nodes(tf):
    node = tf["resource"]["nebius_compute_v1_instance.node"]
    variables = tf["variable"]
    assert node["count"] == "${var.node_count}"
    assert node["resources"] == {"platform": "${var.gpu_platform}", "preset": "${var.gpu_preset}"}
    assert variables["gpu_platform"]["default"] == "gpu-h100-sxm"
    assert variables["gpu_preset"]["default"] == "8gpu-128vcpu-1600gb"
    assert node["boot_disk"]["existing_disk"]["id"] == "${nebius_compute_v1_disk.boot[count.index].id}"
    disk = tf["resource"]["nebius_compute_v1_disk.boot"]
    assert disk["source_image_family"]["image_family"] == "${var.image_family}"
    nic = node["network_interfaces"]
    assert nic["name"] == "eth0"        # the interface name NCCL/GLOO_SOCKET_IFNAME use (cloud-init)
    assert nic["ip_address"]["allocation_id"] == "${nebius_vpc_v1_allocation.node[count.index].id}"
    assert "nebius_vpc_v1_security_group.nodes.id" in str(nic["security_groups"])
    # a public address on node 0 only, unless asked for
    assert squash("count.index == 0 || var.public_ip_all_nodes") in squash(nic["public_ip_address"])
    assert "var.preemptible" in node["preemptible"] and "STOP" in node["preemptible"]


def test_gpu_cluster_joins_the_nodes(tf):
    cluster = tf["resource"]["nebius_compute_v1_gpu_cluster.this"]
    assert cluster["infiniband_fabric"] == "${var.infiniband_fabric}"
    assert squash(cluster["count"]) == squash("${local.use_gpu_cluster ? 1 : 0}")
    assert squash(tf["locals"]["use_gpu_cluster"]) == squash('${var.infiniband_fabric != ""}')
    node = tf["resource"]["nebius_compute_v1_instance.node"]
    assert "nebius_compute_v1_gpu_cluster.this[0].id" in node["gpu_cluster"]
    # only 8-GPU presets can join: a validation says so before anything is created
    assert squash('startswith(var.gpu_preset, "8gpu-")') in squash(tf["variable"]["infiniband_fabric"]["validation"])
    assert "multi_node_without_infiniband" in tf["check"]


def test_shared_filesystem_attached_read_write_on_every_node(tf):
    fs = tf["resource"]["nebius_compute_v1_filesystem.shared"]
    assert fs["type"] == "${var.filesystem_type}" and fs["size_gibibytes"] == "${var.filesystem_size_gib}"
    assert squash(fs["count"]) == squash('${var.existing_filesystem_id == "" ? 1 : 0}')
    node = tf["resource"]["nebius_compute_v1_instance.node"]
    attached = node["filesystems"]
    assert attached["attach_mode"] == "READ_WRITE"
    assert attached["existing_filesystem"]["id"] == "${local.filesystem_id}"
    assert attached["mount_tag"] == "${local.filesystem_mount_tag}"
    assert "count" in node and "filesystems" in node     # one block per node, the same filesystem


def test_shared_filesystem_mounted_at_one_path(tf, cloud_init):
    """The tag the VM gets is the tag the node mounts, at the path every script uses."""
    env = cloud_init["env"]
    assert env["SHARDLAB_FS_TAG"] == tf["locals"]["filesystem_mount_tag"]
    assert env["SHARDLAB_SHARED_DIR"] == tf["variable"]["shared_mount_path"]["default"]
    setup = NODE_SETUP.read_text()
    assert 'echo "$SHARDLAB_FS_TAG $SHARED virtiofs defaults,nofail 0 0" >> /etc/fstab' in setup
    assert 'mountpoint -q "$SHARED" || die' in setup            # a missing mount stops the setup


def test_outputs(tf):
    outputs = tf["output"]
    assert {"nodes", "node_private_addresses", "head_public_address", "ssh_command", "render_command",
            "launch_command", "run_dir", "shared_filesystem_id"} <= set(outputs)
    assert "shardlab-launch --detach" in outputs["launch_command"]["value"]
    assert "local.render_command" in outputs["render_command"]["value"]


# ------------------------------------------------------------------ cloud-init

def template_args_in_compute_tf() -> set[str]:
    text = (TF_DIR / "compute.tf").read_text()
    call = re.search(r'templatefile\("\$\{path\.module\}/cloud-init\.yaml\.tftpl", \{(.*?)\n  \}\)', text, re.S)
    assert call, "compute.tf no longer renders cloud-init.yaml.tftpl with templatefile"
    return set(re.findall(r"^\s+(\w+)\s+=", call.group(1), re.M))


def sample_template_values(rank: int = 1) -> dict:
    """What compute.tf passes for rank `rank` of the default two-node cluster."""
    return {
        "cluster_name": "shardlab", "node_rank": rank, "node_count": 2, "head_address": "10.60.0.5",
        "node_addresses": "10.60.0.5 10.60.0.6", "rdzv_port": 29500, "gpus_per_node": 8, "omp_threads": 16,
        "max_restarts": 3, "infiniband": True, "shared_dir": "/mnt/shardlab", "fs_mount_tag": "shardlab-shared",
        "ssh_user": "shardlab", "venv_dir": "/opt/shardlab/venv", "ssh_keys_json": json.dumps([SSH_KEY]),
        "git_url": "https://github.com/example/shardlab.git", "git_ref": "main", "torch_version": "2.13.0",
        "torch_index_url": "", "setup_wait_minutes": 60,
        "node_setup_b64": base64.b64encode(NODE_SETUP.read_bytes()).decode(),
        "shardlab_launch_b64": base64.b64encode(LAUNCH.read_bytes()).decode(),
    }


def tf_string(value) -> str:
    """How templatefile prints a primitive."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def render_template(values: dict) -> str:
    """The template has only ${name} substitutions and $${ escapes (it says so; this fails otherwise)."""
    text = TEMPLATE.read_text()
    assert "%{" not in text, "template directives appeared: the Python rendering below no longer matches Terraform"
    names = set(re.findall(r"(?<!\$)\$\{([a-z0-9_]+)\}", text))
    assert names == set(values), f"template names {sorted(names ^ set(values))} are not both passed and used"
    out = re.sub(r"(?<!\$)\$\{([a-z0-9_]+)\}", lambda m: tf_string(values[m.group(1)]), text)
    return out.replace("$${", "${")


@pytest.fixture(scope="module")
def cloud_init() -> dict:
    values = sample_template_values()
    assert template_args_in_compute_tf() == set(values), "compute.tf passes other names than this test renders"
    text = render_template(values)
    doc = yaml.safe_load(text)
    files = {f["path"]: f for f in doc["write_files"]}
    env_text = files["/etc/shardlab/cluster.env"]["content"]
    env = dict(re.fullmatch(r"(\w+)='([^']*)'", line).groups() for line in env_text.splitlines() if line)
    return {"text": text, "doc": doc, "files": files, "env": env}


def test_cloud_init_is_cloud_config(cloud_init):
    assert cloud_init["text"].startswith("#cloud-config\n")
    doc = cloud_init["doc"]
    user = doc["users"][0]
    assert user["name"] == "shardlab" and user["ssh_authorized_keys"] == [SSH_KEY]
    assert user["lock_passwd"] is True and doc["ssh_pwauth"] is False


def test_cloud_init_only_references_files_in_the_repository(cloud_init):
    """Everything a node runs is written by its cloud-init from a file in this repository, byte
    for byte; every command it runs is one of those files; every repository path it names exists."""
    files = cloud_init["files"]
    shipped = {"/usr/local/sbin/shardlab-node-setup": NODE_SETUP, "/usr/local/bin/shardlab-launch": LAUNCH}
    for path, source in shipped.items():
        entry = files[path]
        assert entry["encoding"] == "b64" and entry["permissions"] == "0755"
        assert base64.b64decode(entry["content"]) == source.read_bytes(), f"{path} is not {source}"
    for cmd in cloud_init["doc"]["runcmd"]:
        program = cmd[0] if isinstance(cmd, list) else cmd.split()[0]
        assert program in files, f"runcmd runs {program}, which cloud-init does not write"
    # files the Terraform reads exist
    for f in TF_DIR.glob("*.tf"):
        for rel in re.findall(r'(?:file|templatefile)\("\$\{path\.module\}/([^"]+)"', f.read_text()):
            assert (TF_DIR / rel).is_file(), f"{f.name} reads {rel}, which does not exist"
    # repository paths named in the rendered cloud-init and in the scripts exist
    named = re.findall(r"\b((?:infra|configs|scripts|src|tests)/[\w./-]+\.(?:sh|py|ya?ml|tftpl|tf))\b",
                       cloud_init["text"] + NODE_SETUP.read_text() + LAUNCH.read_text())
    for rel in named:
        assert (ROOT / rel).exists() or (TF_DIR / rel).exists(), f"names {rel}, which is not in the repository"


def test_cloud_init_env_matches_what_the_scripts_read(cloud_init):
    env = cloud_init["env"]
    assert env["SHARDLAB_NODE_RANK"] == "1" and env["SHARDLAB_NNODES"] == "2"
    assert env["SHARDLAB_HEAD_ADDR"] == "10.60.0.5" and env["SHARDLAB_NPROC_PER_NODE"] == "8"
    assert env["SHARDLAB_SOCKET_IFNAME"] == "eth0"
    used = set(re.findall(r"\$\{?(SHARDLAB_[A-Z_]+)", NODE_SETUP.read_text() + LAUNCH.read_text()))
    overrides = {"SHARDLAB_ENV_FILE", "SHARDLAB_SETUP_LOG"}       # set by a caller, not by cloud-init
    assert used - overrides <= set(env), f"the scripts read settings cloud-init never writes: {used - overrides - set(env)}"
    assert set(env) <= used, f"cloud-init writes settings nobody reads: {set(env) - used}"


def test_default_run_config_exists_and_renders(tmp_path, tf):
    """The render command's config is in the repository, and it validates for the default
    cluster (2 nodes x 8 GPUs) with the global batch launch.tf adds."""
    config = tf["variable"]["run_config"]["default"]
    assert (ROOT / config).is_file()
    if shutil.which("terraform"):
        pytest.skip("test_terraform_render_command_runs runs the exact printed render command instead")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shardlab", "render", "slurm", config, "--nodes", "2",
                           "--gpus-per-node", "8", "--out", str(out), "train.global_batch_size=128",
                           "parallel.mixed_precision=bf16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "shardlab-config.yaml").is_file()


# ------------------------------------------------------------------ real terraform, offline

@pytest.fixture(scope="module")
def terraform(tmp_path_factory):
    """A root module of variables.tf + launch.tf (no resource, no provider: runs offline) plus
    a probe that renders cloud-init.yaml.tftpl with the test's sample values."""
    binary = shutil.which("terraform")
    if binary is None:
        pytest.skip("terraform binary not installed (the structure is checked with python-hcl2 above)")
    work = tmp_path_factory.mktemp("tf")
    for name in ("variables.tf", "launch.tf", "cloud-init.yaml.tftpl"):
        shutil.copy(TF_DIR / name, work / name)
    shutil.copytree(SCRIPTS, work / "scripts")
    values = {k: v for k, v in sample_template_values().items() if not k.endswith("_b64")}
    hcl_values = "\n".join(f"    {k} = {json.dumps(v)}" for k, v in values.items())
    (work / "probe.tf").write_text(
        'output "cloud_init" {\n'
        '  value = templatefile("${path.module}/cloud-init.yaml.tftpl", {\n'
        f"{hcl_values}\n"
        '    node_setup_b64      = base64encode(file("${path.module}/scripts/node-setup.sh"))\n'
        '    shardlab_launch_b64 = base64encode(file("${path.module}/scripts/shardlab-launch.sh"))\n'
        "  })\n}\n")
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "TF_CLI_CONFIG_FILE": os.devnull, "CHECKPOINT_DISABLE": "1"}
    proc = subprocess.run([binary, "init", "-input=false", "-no-color"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def run(*args: str, variables: dict | None = None) -> subprocess.CompletedProcess:
        var_file = work / "test.tfvars.json"
        var_file.write_text(json.dumps({**REQUIRED_VARS, **(variables or {})}))
        return subprocess.run([binary, *args, "-input=false", "-no-color", f"-var-file={var_file}"], cwd=work,
                              env=env, capture_output=True, text=True, timeout=120)

    return {"binary": binary, "dir": work, "env": env, "run": run}


def test_terraform_fmt(terraform):
    proc = subprocess.run([terraform["binary"], "fmt", "-check", "-recursive", str(TF_DIR)], capture_output=True,
                          text=True, timeout=60, env=terraform["env"])
    assert proc.returncode == 0, f"terraform fmt would change: {proc.stdout}"


@pytest.mark.parametrize("variables, message", [
    ({"network_cidr": "8.8.0.0/16", "subnet_cidr": "8.8.0.0/24"}, "network_cidr must lie inside 10.0.0.0/8"),
    ({"subnet_cidr": "10.61.0.0/24"}, "subnet_cidr must lie inside network_cidr"),
    ({"ssh_allowed_cidrs": ["0.0.0.0/0"]}, "must not open SSH to the whole internet"),
    ({"ssh_allowed_cidrs": []}, "ssh_allowed_cidrs needs 1 to 8 CIDR blocks"),
    ({"infiniband_fabric": "fabric-3", "gpu_preset": "1gpu-16vcpu-200gb"}, "takes only 8-GPU presets"),
    ({"project_id": "my-project"}, "project_id must look like project-"),
    ({"ssh_public_keys": ["not a key"]}, "ssh_public_keys needs at least one key"),
    ({"shared_mount_path": "/home"}, "shared_mount_path must be an absolute path"),
    ({"existing_filesystem_id": "fs-1"}, "existing_filesystem_id must be a filesystem ID"),
    ({"torch_index_url": "http://example.com/x y"}, "torch_index_url must be an https:// URL"),
    ({"run_overrides": ["train.steps=1; rm -rf /"]}, "each run_overrides entry must be key=value"),
])
def test_terraform_rejects_bad_variables(terraform, variables, message):
    proc = terraform["run"]("plan", variables=variables)
    assert proc.returncode != 0, f"plan accepted {variables}"
    assert message in " ".join(proc.stderr.split()), proc.stderr


@pytest.fixture(scope="module")
def tf_outputs(terraform) -> dict:
    """Apply the resource-free module with the example cluster's variables; read its outputs."""
    proc = terraform["run"]("apply", "-auto-approve", variables={"infiniband_fabric": "fabric-3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([terraform["binary"], "output", "-json", "-no-color"], cwd=terraform["dir"],
                         env=terraform["env"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {k: v["value"] for k, v in json.loads(out.stdout).items()}


def test_terraform_renders_cloud_init_like_this_test(tf_outputs):
    assert tf_outputs["cloud_init"] == render_template(sample_template_values())


def test_terraform_render_command_runs(tf_outputs, tmp_path):
    """The exact render command the cluster prints, with the shared filesystem moved to a
    temporary directory and the venv's shardlab: it must validate and write the run."""
    assert tf_outputs["world_size"] == 16
    command = tf_outputs["render_command"]
    assert command.startswith("cd /mnt/shardlab/src/shardlab && /opt/shardlab/venv/bin/shardlab render slurm ")
    assert "--nodes 2 --gpus-per-node 8 --out /mnt/shardlab/jobs/gpt2-small" in command
    assert "train.global_batch_size=128" in command and "parallel.mixed_precision=bf16" in command
    shared = tmp_path / "shared"
    (shared / "src").mkdir(parents=True)
    (shared / "src" / "shardlab").symlink_to(ROOT)
    local = command.replace("/mnt/shardlab", str(shared)).replace("/opt/shardlab/venv/bin/shardlab",
                                                                  f"{sys.executable} -m shardlab")
    proc = subprocess.run(["bash", "-c", local], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resolved = yaml.safe_load((shared / "jobs" / "gpt2-small" / "shardlab-config.yaml").read_text())
    assert resolved["checkpoint"]["dir"] == f"{shared}/checkpoints/gpt2-small"
    assert resolved["checkpoint"]["resume"] == "auto"
    assert resolved["output"]["dir"] == f"{shared}/runs"
    assert resolved["parallel"]["mixed_precision"] == "bf16"
    assert tf_outputs["run_dir"] == "/mnt/shardlab/jobs/gpt2-small"


# ------------------------------------------------------------------ checkov (one run for the module)

POLICIES = TF_DIR / "checkov"


@pytest.fixture(scope="module")
def checkov_report(tmp_path_factory) -> dict:
    """One checkov run over the module and a broken copy of it: checkov has no built-in Nebius
    policies, so the module brings its own (POLICIES), and the broken copy proves they bite."""
    checkov = BIN / "checkov" if (BIN / "checkov").exists() else shutil.which("checkov")
    if checkov is None:
        pytest.skip("checkov is not installed: pip install -e '.[infra]'")
    tree = tmp_path_factory.mktemp("checkov")
    shutil.copytree(TF_DIR, tree / "module", ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    broken = tree / "broken"
    shutil.copytree(tree / "module", broken)
    compute = (broken / "compute.tf").read_text()
    (broken / "compute.tf").write_text(compute.replace(
        "      security_groups   = [{ id = nebius_vpc_v1_security_group.nodes.id }]\n", ""))
    network = (broken / "network.tf").read_text()
    network = network.replace("source_cidrs      = var.ssh_allowed_cidrs", 'source_cidrs      = ["0.0.0.0/0"]')
    network += ('\nresource "nebius_vpc_v1_security_group" "empty" {\n  parent_id  = var.project_id\n'
                '  network_id = nebius_vpc_v1_network.this.id\n}\n')
    (broken / "network.tf").write_text(network)
    assert compute != (broken / "compute.tf").read_text()
    cmd = [str(checkov), "--compact", "--skip-download", "--output", "json", "--framework", "terraform", "secrets",
           "--external-checks-dir", str(POLICIES), "-d", str(tree)]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    reports = json.loads(proc.stdout)
    report: dict[str, list] = {}
    for rep in reports if isinstance(reports, list) else [reports]:
        for kind in ("passed", "failed", "skipped"):
            for check in rep.get("results", {}).get(f"{kind}_checks", []):
                part = "broken" if check["file_path"].startswith("/broken/") else "module"
                report.setdefault(f"{part}_{kind}", []).append(check)
    return report


def test_checkov_no_failed_checks(checkov_report):
    failed = [f"{c['check_id']} {c['resource']} {c['file_path']}" for c in checkov_report.get("module_failed", [])]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    ran = {c["check_id"] for c in checkov_report.get("module_passed", [])}
    assert {"CKV2_SHARDLAB_1", "CKV2_SHARDLAB_2", "CKV2_SHARDLAB_3"} <= ran, f"checkov ran only {ran}"
    for skipped in checkov_report.get("module_skipped", []):      # a skip must say why, in place
        assert skipped.get("suppress_comment", "").strip(), f"{skipped['check_id']} skipped without a reason"


def test_checkov_policies_catch_a_broken_module(checkov_report):
    caught = {(c["check_id"], c["resource"].split("[")[0]) for c in checkov_report.get("broken_failed", [])}
    assert caught == {("CKV2_SHARDLAB_1", "nebius_compute_v1_instance.node"),
                      ("CKV2_SHARDLAB_2", "nebius_vpc_v1_security_rule.ssh"),
                      ("CKV2_SHARDLAB_3", "nebius_vpc_v1_security_group.empty")}


# ------------------------------------------------------------------ shellcheck

@pytest.fixture(scope="module")
def shellcheck() -> str:
    proc = subprocess.run(["bash", str(ROOT / "infra" / "apt-install.sh"), "shellcheck=shellcheck"],
                          capture_output=True, text=True, timeout=400)
    if proc.returncode == 3:
        pytest.skip(f"shellcheck cannot be installed here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return shutil.which("shellcheck") or pytest.skip("shellcheck not on PATH after install")


def test_shellcheck_scripts(shellcheck):
    scripts = sorted(SCRIPTS.glob("*.sh"))
    assert {s.name for s in scripts} == {"node-setup.sh", "shardlab-launch.sh"}
    proc = subprocess.run([shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_shellcheck_printed_commands(shellcheck, tf_outputs, tmp_path):
    """The command lines the outputs print are shell too."""
    launch = ('for a in 10.60.0.5 10.60.0.6; do ssh -J shardlab@203.0.113.9 shardlab@$a '
              'shardlab-launch --detach /mnt/shardlab/jobs/gpt2-small; done')
    # launch_command needs resource attributes, so it is rebuilt from outputs.tf's format string
    fmt = re.search(r'"(for a in %s; do ssh -J %s %s@\$a shardlab-launch --detach %s; done)"',
                    (TF_DIR / "outputs.tf").read_text())
    assert fmt and fmt.group(1) % ("10.60.0.5 10.60.0.6", "shardlab@203.0.113.9", "shardlab",
                                   "/mnt/shardlab/jobs/gpt2-small") == launch
    script = tmp_path / "printed.sh"
    script.write_text(f"#!/bin/bash\n{tf_outputs['render_command']}\n{launch}\n")
    proc = subprocess.run([shellcheck, "--severity=style", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


# ------------------------------------------------------------------ shardlab-launch on this host

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_node(tmp_path: Path, rank: int, nnodes: int = 2, port: int = 29500, freeze: str = "same") -> Path:
    """cluster.env for node `rank` of a cluster whose shared filesystem is tmp_path/shared and
    whose 'nodes' are all this host; marks the node ready as node-setup.sh would."""
    shared = tmp_path / "shared"
    nodes = shared / ".shardlab-cluster" / "test" / "nodes"
    nodes.mkdir(parents=True, exist_ok=True)
    (nodes / f"{rank}.ready").write_text(f"host=test\nfreeze={freeze}\n")
    values = {**{k: v for k, v in sample_template_values(rank).items() if not k.endswith("_b64")},
              "cluster_name": "test", "node_count": nnodes, "head_address": "127.0.0.1",
              "node_addresses": " ".join(["127.0.0.1"] * nnodes), "rdzv_port": port, "gpus_per_node": 0,
              "omp_threads": 1, "max_restarts": 0, "infiniband": False, "shared_dir": str(shared),
              "venv_dir": sys.prefix}
    env_text = yaml.safe_load(render_template({**values, "node_setup_b64": "", "shardlab_launch_b64": ""}))
    content = next(f["content"] for f in env_text["write_files"] if f["path"] == "/etc/shardlab/cluster.env")
    # one CPU worker per fake node (the real nodes: one per GPU)
    content = content.replace("SHARDLAB_NPROC_PER_NODE='0'", "SHARDLAB_NPROC_PER_NODE='1'")
    content = content.replace("SHARDLAB_SOCKET_IFNAME='eth0'", "SHARDLAB_SOCKET_IFNAME='lo'")
    env_file = tmp_path / f"node{rank}.env"
    env_file.write_text(content)
    return env_file


def launch(env_file: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDLAB_ENV_FILE": str(env_file), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_launch_refuses_a_run_outside_the_shared_filesystem(tmp_path):
    env_file = fake_node(tmp_path, 0)
    proc = launch(env_file, str(tmp_path / "elsewhere"))
    assert proc.returncode == 2 and "is not under the shared filesystem" in proc.stderr


def test_launch_refuses_until_every_node_is_ready_and_alike(tmp_path):
    env_file = fake_node(tmp_path, 0)
    run_dir = tmp_path / "shared" / "jobs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "shardlab-config.yaml").write_text("seed: 0\n")
    proc = launch(env_file, str(run_dir))
    assert proc.returncode == 2 and "node 1 has not finished its setup" in proc.stderr
    fake_node(tmp_path, 1, freeze="other")
    proc = launch(env_file, str(run_dir))
    assert proc.returncode == 2 and "node 1 has other packages" in proc.stderr
    proc = launch(env_file, str(tmp_path / "shared" / "jobs" / "unrendered"))
    assert proc.returncode == 2 and "render the run first" in proc.stderr


@pytest.mark.slow
def test_two_nodes_render_and_launch_on_this_host(tmp_path):
    """Two fake nodes (one CPU worker each) on this host: render with `shardlab render slurm`
    into the 'shared filesystem', start shardlab-launch for both, and check the run trained
    at world size 2 with its checkpoint and metrics on the shared filesystem."""
    port = free_port()
    env_files = [fake_node(tmp_path, r, port=port) for r in (0, 1)]
    shared = tmp_path / "shared"
    run_dir = shared / "jobs" / "e2e"
    render = subprocess.run(
        [sys.executable, "-m", "shardlab", "render", "slurm", "configs/gpt-tiny.yaml", "--nodes", "2",
         "--gpus-per-node", "0", "--nproc-per-node", "1", "--out", str(run_dir), "model.preset=gpt-nano",
         "data.seq_len=32", "train.steps=4", "checkpoint.every_steps=2", "output.progress=false",
         "output.tensorboard=false", "output.run_name=e2e", f"checkpoint.dir={shared}/checkpoints/e2e",
         f"output.dir={shared}/runs"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert render.returncode == 0, render.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(["bash", str(LAUNCH), str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, "SHARDLAB_ENV_FILE": str(f)}) for f in env_files]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two-node launch did not finish:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "node 0 of 2 (127.0.0.1), 1 worker(s), rendezvous 127.0.0.1:" in outputs[0]
    metrics = json.loads((shared / "runs" / "e2e" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 4
    assert any((shared / "checkpoints" / "e2e").rglob("*")), "no checkpoint on the shared filesystem"
