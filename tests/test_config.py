"""Every config error is caught before any worker starts, with a message naming key and fix."""

import subprocess
import sys

import pytest

import shardlab.loop.launcher
from shardlab import cli
from shardlab.config import ConfigError, dump_config, load_config


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if the launcher is ever reached."""
    def forbidden(*a, **k):
        raise AssertionError("a worker was started despite bad input")
    monkeypatch.setattr(shardlab.loop.launcher, "launch_local", forbidden)
    monkeypatch.setattr(shardlab.loop.launcher, "launch_elastic", forbidden)


def _yaml(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


CASES = [
    # (overrides, expected fragments of the message)
    (["train.step=5"], ["unknown config key 'train.step'", "did you mean 'train.steps'"]),
    (["lr=0.1"], ["unknown config key 'lr'", "did you mean 'train.lr'"]),
    (["trian.steps=5"], ["unknown config key 'trian.steps'", "did you mean 'train.steps'"]),
    (["train.steps=ten"], ["train.steps must be an integer", "'ten'"]),
    (["train.lr=fast"], ["train.lr must be a number"]),
    (["parallel.reshard_after_forward=maybe"], ["parallel.reshard_after_forward must be true/false"]),
    (["train.steps=0"], ["train.steps must be >= 1"]),
    (["train.lr=-1"], ["train.lr must be > 0"]),
    (["model.dropout=1.5"], ["model.dropout must be in [0, 1)"]),
    (["parallel.strategy=zero4"], ["parallel.strategy: unknown value 'zero4'",
                                   "single, ddp, zero3, fsdp, ddp-minimal, zero3-minimal, fsdp-minimal, torch-ddp, torch-fsdp"]),
    (["model.name=vit"], ["model.name: unknown value 'vit'", "gpt, resnet, mlp"]),
    (["model.preset=gpt-huge"], ["model.preset: unknown value 'gpt-huge'", "gpt-tiny"]),
    (["data.source=hub"], ["data.source: unknown value 'hub'", "builtin, text, tokens, sft, cifar10, synthetic"]),
    (["train.global_batch_size=9"], ["train.global_batch_size=9 has no layout at world size 2",
                                     "world sizes that work: 1, 3, 9"]),
    (["data.source=text", "data.path=/no/such/file.txt"], ["data.path '/no/such/file.txt'", "no such file"]),
    (["data.source=text"], ["data.source=text needs data.path"]),
    (["model.name=resnet", "data.source=cifar10", "data.path=/no/such/dir"], ["cifar-10-batches-py", "/no/such/dir"]),
    (["data.seq_len=4096"], ["data.seq_len (4096) exceeds the model's block_size"]),
    (["checkpoint.resume=/no/such/ckpt"], ["checkpoint.resume", "does not exist"]),
    (["model.name=resnet"], ["data.source=builtin gives tokens, but model.name=resnet takes images",
                             "use model.name=gpt or hf, or data.source=synthetic"]),
    (["model.name=mlp", "model.mlp_sizes=[4]"], ["model.mlp_sizes must list at least an input and an output"]),
    (["model.name=resnet", "data.source=synthetic", "model.num_classes=1"], ["model.num_classes >= 2"]),
    (["model.n_embd=30", "model.n_head=4"], ["model.n_embd (30) must be divisible by model.n_head (4)"]),
    (["parallel.strategy=ddp", "parallel.accumulate=sharded"],
     ["parallel.accumulate=sharded", "parallel.strategy=zero3 or fsdp or torch-fsdp only, not of ddp"]),
    (["parallel.strategy=torch-ddp", "parallel.accumulate=sharded"], ["not of torch-ddp"]),
    (["parallel.accumulate=global"], ["parallel.accumulate: unknown value 'global'", "local, sharded"]),
]


@pytest.mark.parametrize("overrides,fragments", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_override_fails_before_workers(overrides, fragments, no_workers, capsys):
    code = cli.main(["train", "--nproc", "2", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    for fragment in fragments:
        assert fragment in err, err


def test_batch_not_divisible_by_world(no_workers, capsys):
    code = cli.main(["train", "--nproc", "3", "train.global_batch_size=16", "train.micro_batch_size=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.global_batch_size=16 has no layout at world size 3" in err
    assert "world sizes that work: 1, 2, 4, 8, 16" in err


def test_yaml_syntax_error_names_file_and_line(tmp_path, no_workers, capsys):
    path = _yaml(tmp_path, "seed: 1\ntrain:\n  steps: 5\n  lr: [0.1\nmodel:\n  name: gpt\n")
    code = cli.main(["train", path, "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}:" in err and "YAML syntax error" in err
    line = int(err.split(f"{path}:")[1].split(":")[0])
    assert 4 <= line <= 6, err


def test_unknown_key_in_yaml_file(tmp_path, no_workers, capsys):
    path = _yaml(tmp_path, "train:\n  stepz: 5\n")
    assert cli.main(["train", path, "--nproc", "2"]) == 2
    assert "unknown config key 'train.stepz'; did you mean 'train.steps'" in capsys.readouterr().err


def test_missing_config_file(no_workers, capsys):
    assert cli.main(["train", "nope.yaml", "--nproc", "2"]) == 2
    assert "config file 'nope.yaml' not found" in capsys.readouterr().err


def test_single_strategy_with_many_workers(no_workers, capsys):
    assert cli.main(["train", "parallel.strategy=single", "--nproc", "2"]) == 2
    assert "parallel.strategy=single runs one process" in capsys.readouterr().err


def test_print_config_round_trips(tmp_path, capsys):
    assert cli.main(["train", "configs/gpt-tiny.yaml", "train.steps=7", "train.lr=1e-3", "--print-config"]) == 0
    text = capsys.readouterr().out
    path = _yaml(tmp_path, text)
    cfg = load_config(path)
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3
    assert dump_config(cfg) == text


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-small", "resnet-cifar10"])
def test_shipped_configs_parse(name):
    if name == "resnet-cifar10":  # needs a data folder: the error must say so
        with pytest.raises(ConfigError, match="cifar-10-batches-py"):
            load_config(f"configs/{name}.yaml")
    else:
        load_config(f"configs/{name}.yaml")


def test_cli_exit_code_and_no_worker_output(tmp_path):
    """The real command: non-zero exit, the message, and no torch elastic / worker output."""
    # timeout: a hang guard only (it fails before any worker starts: seconds, tens on a loaded machine)
    out = subprocess.run([sys.executable, "-m", "shardlab", "train", "--nproc", "2", "train.stepz=3",
                          f"output.dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert "did you mean 'train.steps'" in out.stderr
    assert "[rank" not in out.stderr and "torch.distributed" not in out.stderr
    assert list(tmp_path.iterdir()) == []


# -- docs/training.md's key table is the config ------------------------------------------------------
def _documented_keys() -> dict[str, tuple[str, str]]:
    """key -> (its default as the table writes it, the row's meaning), from docs/training.md's
    table. A row names keys in backticks; a name without a dot is a sibling of the row's first."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    table = text[text.index("| key | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    out = {}
    for line in table:
        key_cell, default_cell, meaning = [c.strip() for c in line.strip("|").split(" | ", 2)]
        names = re.findall(r"`([^`]+)`", key_cell)
        prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        keys = [n if n == names[0] else prefix + n for n in names]
        defaults = re.split(r",\s*(?![^\[]*\])", default_cell)  # commas outside [...]
        assert len(defaults) == len(keys), line
        out.update({k: (d, meaning) for k, d in zip(keys, defaults)})
    return out


def _config_keys() -> dict[str, object]:
    """Every shardlab config key and its default; model keys of models registered from outside
    shardlab (a test's toy model) are left out."""
    import dataclasses

    from shardlab.config import Config, ModelConfig

    ours = {f.name for cls in ModelConfig.__mro__ if cls.__module__.startswith("shardlab.")
            and dataclasses.is_dataclass(cls) for f in dataclasses.fields(cls)}
    out = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if prefix == "model." and k not in ours:
                continue
            if isinstance(v, dict):
                walk(v, prefix + k + ".")
            else:
                out[prefix + k] = v

    walk(Config().to_dict(), "")
    return out


def test_training_md_key_table_matches_the_config():
    import yaml

    from shardlab.data import DATA_SOURCES
    from shardlab.engines import STRATEGIES
    from shardlab.models import MODELS

    documented, config = _documented_keys(), _config_keys()
    assert not set(config) - set(documented), f"keys missing from docs/training.md: {sorted(set(config) - set(documented))}"
    assert not set(documented) - set(config), f"docs/training.md names unknown keys: {sorted(set(documented) - set(config))}"
    for key, (default, _) in documented.items():
        assert yaml.safe_load(default) == config[key], f"docs/training.md: {key} defaults to {config[key]!r}, not {default}"
    choices = {"model.name": [n for n, spec in MODELS.items() if spec.build.__module__.startswith("shardlab.")],
               "data.source": [n for n, s in DATA_SOURCES.items() if s.build.__module__.startswith("shardlab.")],
               "parallel.strategy": [n for n, e in STRATEGIES.items() if e.target.startswith("shardlab.")]}
    for key, names in choices.items():
        meaning = documented[key][1]
        assert names and all(f"`{n}`" in meaning for n in names), f"docs/training.md: {key} should list {names}"
