"""The CLI answers before it imports torch (issue 46): `shardlab --help`, `shardlab configs`, a
command's `--help` and a config error; the names the early check knows without the registries
are the registries' own; each shipped config states the parameter count its model has as built.
What each answer costs beside `python -c "import torch"`: docs/training.md, "How fast the CLI answers"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from shardlab import cli
from shardlab.shipped import shipped_configs, stated_parameters

# Run in a fresh interpreter (the test process imported torch long ago): each command through
# cli.main, then whether torch was imported; then what the early check said, beside what the
# full load says with the registries imported; then the early check's names beside the registries'.
FRESH = r"""
import contextlib, io, json, sys
from shardlab import cli
from shardlab.config_checks import precheck
from shardlab.errors import ConfigError
out = {"torch": {}, "early": {}, "full": {}}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    out["torch"][" ".join(argv)] = [code, "torch" in sys.modules, err.getvalue()]
for override in json.loads(sys.argv[2]):
    try:
        precheck("gpt-tiny", [override])
        out["early"][override] = None
    except ConfigError as e:
        out["early"][override] = str(e)
from shardlab.config import load_config
for override in json.loads(sys.argv[2]):
    try:
        load_config("gpt-tiny", [override])
        out["full"][override] = None
    except ConfigError as e:
        out["full"][override] = str(e)
from shardlab import config, config_checks as c, config_parse as p
from shardlab.engines import api, compile as cm
from shardlab.models import lm_loss
out["same names"] = [c.shipped_choices() == config.registered(),
                     p.known_keys(c.config_shape(c.MODEL_KEYS)) == p.known_keys(config.Config),
                     [c.LOSS_MODES, c.AC_MODES, c.COMPILE_MODES, c.ACCUMULATE_MODES] ==
                     [lm_loss.LOSS_MODES, cm.AC_MODES, cm.COMPILE_MODES, api.ACCUMULATE_MODES]]
print(json.dumps(out))
"""

NO_TORCH = [["--help"], ["configs"], ["configs", "gpt2-small"], ["train", "--help"], ["doctor", "--help"],
            ["train", "configs/gpt-tiny.yaml", "bogus.key=1"], ["train", "gpt-tiny", "model.n_layr=2"],
            ["train", "gpt-tiny", "train.steps=0"], ["train", "gpt-tiny", "parallel.strategy=zero4"],
            ["train", "no-such-config"]]
# errors the early check finds, and one it leaves to the full load (a model key's value)
OVERRIDES = ["bogus.key=1", "model.n_layr=2", "train.steps=ten", "train.lr=-1", "parallel.strategy=zero4",
             "model.name=gtp", "data.source=tokenz", "checkpoint.async=maybe", "model.dropout=1.5", "train.steps=3"]


@pytest.fixture(scope="module")
def fresh() -> dict:
    env_free = {k: v for k, v in os.environ.items() if k != "SHARDLAB_PLUGINS"}
    run = subprocess.run([sys.executable, "-c", FRESH, json.dumps(NO_TORCH), json.dumps(OVERRIDES)],
                         capture_output=True, text=True, timeout=300, env=env_free)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("argv", [" ".join(a) for a in NO_TORCH])
def test_answers_without_importing_torch(fresh, argv):
    code, torch_imported, err = fresh["torch"][argv]
    assert not torch_imported, f"`shardlab {argv}` imported torch"
    assert code == (2 if "=" in argv or "no-such" in argv else 0), err
    if code:
        assert err.startswith("error: ") and err.count("\n") == 1, err  # one line


def test_the_early_check_says_what_the_full_load_says(fresh):
    early, full = fresh["early"], fresh["full"]
    assert early["model.dropout=1.5"] is None and full["model.dropout=1.5"]  # a model key's value: the full load
    assert early["train.steps=3"] is None and full["train.steps=3"] is None
    for override in OVERRIDES:
        if early[override] is not None:
            assert early[override] == full[override], override
    assert sum(e is not None for e in early.values()) == len(OVERRIDES) - 2


def test_names_known_without_the_registries_are_the_registries(fresh):
    """The shipped names and keys the early check uses, against the live registries and constants
    (read in the fresh interpreter: no plugin there, where this process may hold tests/toys.py's)."""
    registries, model_keys, modes = fresh["same names"]
    assert registries and model_keys and modes


def test_each_command_line_is_its_parser_s():
    """`shardlab --help` lists every command by the help line cli.py holds; the parser the command's
    module adds (when it is the one run) says the same."""
    for name, command in cli.COMMANDS.items():
        parser = cli.build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        said = {a.dest: a.help for a in sub._choices_actions}
        assert said[name] == command.help, name
        assert sub.choices[name].get_default("func") is not None, name


def test_shipped_configs_state_their_parameters_as_built():
    """Each shipped config's `# Parameters: N as built` against its model built on the meta device;
    sft-mistral-7b's files (model.hf_path) are not here: the shipped JSON of the same shape stands in."""
    from shardlab.config import Config
    from shardlab.config_parse import build, read_raw
    from shardlab.plan.model import param_count

    for name, path in shipped_configs().items():
        stand_in = ["model.hf_path=null", "model.hf_config=mistral-7b"] if name == "sft-mistral-7b" else []
        built = param_count(build(Config, read_raw(str(path), stand_in)))  # built, not validated: data.path may be absent
        assert stated_parameters(path) == built, (name, built)
