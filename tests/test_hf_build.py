"""One construction of a Hugging Face model, checked end to end: a buffer that nothing derives is
refused before any worker starts (in the model's config check, one line naming it) while a
persistent buffer in the files is loaded from them; Gemma 2 trained by `shardlab train` (packing on
and off, float64 and float32) has transformers' step-1 loss, records and prints its attention
implementation once, and with output.progress=false exports without transformers' progress bars."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers import initialization as init  # noqa: E402
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402

from shardlab.errors import ConfigError  # noqa: E402


# -- a toy HF-style model: a persistent buffer (in the files) and a non-persistent one ---------------
class ToyConfig(PretrainedConfig):
    model_type = "shardlab_toy"

    def __init__(self, vocab_size: int = 16, hidden_size: int = 8, derive_table: bool = True, **kw):
        self.vocab_size, self.hidden_size, self.derive_table = vocab_size, hidden_size, derive_table
        super().__init__(**kw)


class ToyForCausalLM(PreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("scale", torch.full((config.hidden_size,), 2.0))  # persistent: in the files
        self.register_buffer("table", torch.arange(config.hidden_size, dtype=torch.float32), persistent=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            init.constant_(self.scale, 2.0)
            if self.config.derive_table:
                init.copy_(self.table, torch.arange(self.config.hidden_size, dtype=torch.float32))

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=None, **kw):
        return CausalLMOutput(logits=self.head(self.embed(input_ids) * self.scale + self.table))


try:
    AutoConfig.register("shardlab_toy", ToyConfig)
    AutoModelForCausalLM.register(ToyConfig, ToyForCausalLM)
except ValueError:  # registered already (the module imported twice)
    pass


def _toy_cfg(tmp_path, derive: bool, **model):
    from shardlab.config import load_config

    path = tmp_path / f"toy-{derive}.json"
    path.write_text(json.dumps({"model_type": "shardlab_toy", "derive_table": derive}))
    keys = {"hf_config": str(path), **model}
    return load_config("configs/sft-mistral-tiny.yaml", ["parallel.strategy=single", f"output.dir={tmp_path}",
                                                         "data.source=synthetic", "data.packing=false",
                                                         *(f"model.{k}={v}" for k, v in keys.items())])


def test_underived_buffer_is_refused_in_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError) as e:
        _toy_cfg(tmp_path, derive=False)
    message = str(e.value)
    assert "model.table" in message and "scale" not in message and "\n" not in message, message
    _toy_cfg(tmp_path, derive=True)  # the same model whose _init_weights derives it passes


def test_persistent_buffer_comes_from_the_files(tmp_path):
    """A meta build materialized by an engine: `scale` (persistent) from the files, not the 2.0 the
    model's own init would write; `table` (non-persistent) derived."""
    import shardlab
    from shardlab.models import build_model

    toy = ToyForCausalLM(ToyConfig(vocab_size=16, hidden_size=8))
    toy.scale.fill_(7.0)
    toy.save_pretrained(tmp_path / "toy")
    cfg = _toy_cfg(tmp_path, derive=True, hf_config="null", hf_path=str(tmp_path / "toy"))  # validated: passes
    model = shardlab.parallelize(build_model(cfg.model, device="meta"), "single", device="cpu")
    buffers = dict(model.named_buffers())
    assert torch.equal(buffers["model.scale"], torch.full((8,), 7.0))
    assert torch.equal(buffers["model.table"], torch.arange(8, dtype=torch.float32))
    assert torch.equal(model.model.head.weight, toy.head.weight)


# -- Gemma 2 through `shardlab train` -----------------------------------------------------------
@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from tests.hf_families import write_family

    out = tmp_path_factory.mktemp("gemma2")
    write_family("gemma2", str(out / "model"))
    (out / "d.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Add {i}"},
        {"role": "assistant", "content": "the value " * (1 + i % 3)}]}) + "\n" for i in range(12)))
    return out


def _gemma2_cfg(d, packing: bool, dtype: str, name: str, *extra):
    from shardlab.config import load_config

    return load_config("configs/sft-mistral-tiny.yaml", [
        "model.hf_config=null", f"model.hf_path={d}/model", f"model.hf_dtype={dtype}", f"data.path={d}/d.jsonl",
        f"data.packing={str(packing).lower()}", "data.seq_len=64", "data.val_fraction=0.0", "data.shuffle=false",
        "train.steps=1", "train.micro_batch_size=1", "train.lr=1e-3", "train.eval_batches=1",
        "train.memory_tracking=none", "parallel.strategy=single", "export.format=none", "checkpoint.every_steps=0",
        f"output.dir={d}", f"output.run_name={name}", "output.progress=false", "output.tensorboard=false", *extra])


def _transformers_loss(path: str, rows, dtype: torch.dtype) -> tuple[float, float]:
    """(float64 cross-entropy of transformers' logits, transformers' own .loss), token-weighted over
    the rows, each row as transformers takes it (packed: position ids that restart)."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    ref.train()
    ce = own = count = 0.0
    for x, y in rows:
        x, y = x[None].long(), y[None].long()
        kwargs = {"input_ids": x[:, 0], "position_ids": x[:, 1]} if x.dim() == 3 else {"input_ids": x}
        out = ref(**kwargs, labels=y, shift_labels=y, use_cache=False)  # y is shifted already
        n = int((y != -100).sum())
        ce += F.cross_entropy(out.logits[0].double(), y[0], ignore_index=-100, reduction="sum").item()
        own += out.loss.item() * n
        count += n
    return ce / count, own / count


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_gemma2_step_one_loss_is_transformers(gemma2, packing, capsys, monkeypatch):
    from shardlab.data import build_datasets
    from shardlab.loop import train as T
    from tests.checkpoint_helpers import runtime

    monkeypatch.setenv("SHARDLAB_CACHE", str(gemma2 / "cache"))
    for dtype, torch_dtype, rel in (("fp64", torch.float64, 1e-12), ("fp32", torch.float32, 1e-6)):
        name = f"{'packed' if packing else 'padded'}-{dtype}"
        rows = build_datasets(_gemma2_cfg(gemma2, packing, dtype, name)).train
        extra = [f"train.global_batch_size={len(rows)}"] + (["export.format=hf"] if dtype == "fp64" else [])
        got = T.train(_gemma2_cfg(gemma2, packing, dtype, name, *extra), runtime(0, 1, "single"))["losses"][0]
        ce, own = _transformers_loss(str(gemma2 / "model"), [rows[i] for i in range(len(rows))], torch_dtype)
        assert got == pytest.approx(ce if dtype == "fp64" else own, rel=rel, abs=0), (name, got, ce, own)
        with open(gemma2 / name / "run_args.json") as f:
            attention = json.load(f)["attention"]
        packed = "transformers' masks from position ids" if packing else None
        assert attention == {"implementation": "eager", "packed_examples": packed}
    printed = capsys.readouterr()
    assert printed.out.count("model: attention eager") == 2, printed.out
    assert "Writing model shards" not in printed.err + printed.out  # output.progress=false: no transformers bar
    assert os.path.isfile(gemma2 / f"{'packed' if packing else 'padded'}-fp64" / "hf" / "model.safetensors")


def test_gemma2_later_packed_example_moves_no_earlier_logit(gemma2, monkeypatch):
    """On the SFT rows themselves: every later example of a packed row changed, the earlier
    examples' logits stay the same to the last bit (float64, eager: Gemma 2's implementation)."""
    import shardlab
    from shardlab.data import build_datasets
    from shardlab.models import build_model

    monkeypatch.setenv("SHARDLAB_CACHE", str(gemma2 / "cache"))
    cfg = _gemma2_cfg(gemma2, True, "fp64", "isolation")
    rows = build_datasets(cfg).train
    model = shardlab.parallelize(build_model(cfg.model, device="meta"), "single", device="cpu").eval()
    x = next(x for x, _ in (rows[i] for i in range(len(rows))) if int((x[1] == 0).sum()) >= 3)[None].long()
    starts = (x[0, 1] == 0).nonzero().flatten().tolist()
    changed = x.clone()
    changed[0, 0, starts[1]:] = torch.randint(3, 300, (x.shape[-1] - starts[1],), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(x)[0, :starts[1]], model(changed)[0, :starts[1]]
    assert torch.equal(a, b), (a - b).abs().max().item()
