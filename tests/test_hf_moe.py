"""Mixtures of experts beyond the family sweep (tests/test_hf_families.py proves their builds,
packing, float64 loss with the router term, export and verify): the router's loss in float32 on
both loss paths against transformers' own `.loss`, and what an fsdp rank reads of a per-expert
checkpoint ([Note: reading what transformers converts] in models/hf_convert.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import shardlab  # noqa: E402
from tests.hf_families import write_family  # noqa: E402
from tests.test_hf_families import examples, packed_row, shardlab_model  # noqa: E402

MOE = ("mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {n: write_family(n, str(tmp_path_factory.mktemp(n))) for n in MOE}


@pytest.mark.parametrize("path", ["full", "chunked"])
@pytest.mark.parametrize("name", MOE)
def test_router_loss_equals_transformers_in_float32(dirs, name, path):
    """output_router_logits=true: shardlab's step loss (float32, full or chunked) equals transformers'
    `.loss` on the same packed row to 1e-6 relative, and the router term is what makes it so."""
    from transformers import AutoModelForCausalLM

    model = shardlab_model(dirs[name], dtype="fp32")
    inner = shardlab.engine_of(model).unwrapped()
    assert inner.use_loss(path) is None and inner.loss == path
    x, y = packed_row(examples(name))
    loss = model(x, y).item()
    ref = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32)
    labels = torch.cat([torch.full((1, 1), -100), y[:, :-1]], dim=1)
    out = ref(input_ids=x[:, 0], position_ids=x[:, 1], labels=labels, use_cache=False)
    assert loss == pytest.approx(out.loss.item(), rel=1e-6, abs=0), (name, path, loss, out.loss.item())
    without = out.loss.item() - ref.router_aux_loss_coef * out.aux_loss.item()
    assert abs(loss - without) > 1e-3 * abs(without)  # the router term is in, not lost in the tolerance
    _assert_router_statistics(model, x, y, out, ref)


def _assert_router_statistics(model, x, y, out, ref) -> None:
    """metrics.json's `router` section (loop/router_stats.py, one process) after that one training
    forward: each layer's tokens per expert are transformers' own top-k choices, the balancing loss
    its aux_loss; an evaluation forward adds nothing; the report lists the layers."""
    from types import SimpleNamespace

    from shardlab.loop.router_stats import router_section
    from shardlab.observe.report import _router

    k = ref.config.num_experts_per_tok
    want = [torch.bincount(torch.topk(logits, k).indices.reshape(-1), minlength=logits.shape[-1]).tolist()
            for logits in out.router_logits]
    model.eval()
    model(x, y)  # not counted
    model.train()
    run = SimpleNamespace(engine=shardlab.engine_of(model), rt=SimpleNamespace(distributed=False, world_size=1))
    section = router_section(run)["router"]
    assert section["tokens_per_expert"] == want and section["top_k"] == k, (section, want)
    assert section["balance_loss_mean"] == pytest.approx(out.aux_loss.item(), rel=1e-6)
    assert section["balance_micro_batches"] == 1 and section["aux_loss_coef"] == ref.router_aux_loss_coef
    html = _router(SimpleNamespace(metrics={"router": section}))
    assert all(layer in html for layer in section["layers"]) and "balancing loss" in html


@pytest.mark.parametrize("name", MOE)
def test_a_flat_range_of_fused_experts_reads_only_its_experts(dirs, name):
    """fsdp's range reads of a fused expert tensor equal the converted tensor's elements, and a
    range inside one expert reads that expert's stored tensors only."""
    from shardlab.models.hf_load import SafetensorsReader, checkpoint_names

    inner = shardlab.engine_of(shardlab_model(dirs[name])).unwrapped()
    reader = SafetensorsReader(dirs[name])
    checkpoint_names(inner.hf_model, reader)
    assert len(reader.conversions) == 4  # gate_up_proj and down_proj of 2 layers
    g = torch.Generator().manual_seed(0)
    for key in reader.conversions:
        whole = reader.get(key).reshape(-1)
        for _ in range(4):
            a, b = sorted(torch.randint(0, whole.numel() + 1, (2,), generator=g).tolist())
            if a < b:
                assert torch.equal(reader.read_flat_range(key, a, b), whole[a:b]), (key, a, b)
        shape = reader.shape(key)
        row = whole.numel() // shape[0]
        before = reader.bytes_read
        reader.read_flat_range(key, row + 1, 2 * row - 1)  # inside expert 1
        assert reader.bytes_read - before == whole.numel() * whole.element_size() // shape[0], key


def test_lora_on_fused_experts_is_refused_in_one_line(tmp_path):
    """DeepSeek-V3: a `down_proj` target makes peft adapt the fused expert parameters by
    parametrization, which the engines do not carry (fsdp failed in the forward): refused at config
    time, in one line; attention-only targets pass, and so do the default ones (the attention's)."""
    from transformers import AutoModelForCausalLM

    from shardlab.models.hf import LoRAKeys, lora_parameter_problem, lora_target_problem
    from shardlab.models.hf_lora import default_targets
    from shardlab.models.hf_model import load_hf_config
    from tests.test_hf_families import section

    path = write_family("deepseek_v3", str(tmp_path / "ds"))
    sec = section(path)
    sec.lora = LoRAKeys(rank=2, target_modules=["q_a_proj", "down_proj"])
    problem = lora_parameter_problem(sec)
    assert problem and "\n" not in problem and "experts.down_proj" in problem, problem
    sec.lora = LoRAKeys(rank=2, target_modules=["q_a_proj", "o_proj"])
    assert lora_parameter_problem(sec) is None
    # no targets named: peft has no default for deepseek_v3, so shardlab's is the attention's Linear layers
    sec.lora = LoRAKeys(rank=2)
    assert lora_target_problem(sec, "deepseek_v3") is None and lora_parameter_problem(sec) is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(sec))
    assert default_targets(model) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]


def test_default_lora_targets_of_a_converted_family_are_peft_s(dirs):
    """Mixtral: peft's own default (q_proj, v_proj), named by shardlab, since peft 0.21 given no
    targets empties the list for a family with a weight conversion and refuses."""
    from transformers import AutoModelForCausalLM

    from shardlab.models.hf import LoRAKeys, lora_parameter_problem, lora_target_problem
    from shardlab.models.hf_lora import default_targets
    from shardlab.models.hf_model import load_hf_config
    from tests.test_hf_families import section

    sec = section(dirs["mixtral"])
    sec.lora = LoRAKeys(rank=2)
    assert lora_target_problem(sec, "mixtral") is None and lora_parameter_problem(sec) is None
    with torch.device("meta"):
        assert default_targets(AutoModelForCausalLM.from_config(load_hf_config(sec))) == ["q_proj", "v_proj"]


def test_bloom_packing_is_refused_before_workers_and_its_unpacked_loss_is_transformers(tmp_path):
    """Bloom builds its ALiBi bias from a 2-D mask and takes no 4-D one (the workers crashed with a
    ValueError in modeling_bloom.py): data.packing=true is one line before any worker starts; padded
    rows train with transformers' loss (float64 cross-entropy of its logits, 1e-12)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from shardlab.models.hf import _packing_problem
    from tests.test_hf_families import padded_rows, section

    path = write_family("bloom", str(tmp_path / "bloom"))
    problem = _packing_problem(section(path))
    assert problem and "\n" not in problem and "set data.packing=false" in problem, problem
    x, y = padded_rows(examples("bloom"))
    loss = shardlab_model(path)(x, y).item()
    logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)(input_ids=x, use_cache=False).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100).item()
    assert loss == pytest.approx(want, rel=1e-12, abs=0), (loss, want)


SHARDED = (("mixtral", "fsdp"), ("qwen3_moe", "torch-fsdp"))  # one engine per converter: 20 s in all


def _sharded_loads(rank: int, world: int, dirs: dict[str, str]) -> dict:
    """MoE directories built on the meta device by a range-reading engine at `world` ranks: the
    full state, and the bytes this rank read from the files; then, after one training forward of
    the same packed row on every rank, metrics.json's router section as gathered at the end."""
    from types import SimpleNamespace

    from shardlab.loop.router_stats import router_section

    out = {}
    for name, strategy in SHARDED:
        model = shardlab_model(dirs[name], strategy)
        out[name, strategy] = (shardlab.full_state_dict(model), shardlab.engine_of(model).unwrapped()._reader.bytes_read)
        model(*packed_row(examples(name)))
        run = SimpleNamespace(engine=shardlab.engine_of(model), rt=SimpleNamespace(distributed=True, world_size=world))
        out["router", name] = router_section(run)["router"]
    return out


@pytest.mark.slow
def test_fsdp_and_torch_fsdp_at_3_ranks_load_per_expert_checkpoints(dirs):
    """At 3 ranks (shards cut the fused expert tensors mid-expert), fsdp's and torch-fsdp's loads
    equal transformers' from_pretrained bit for bit, and no rank reads the whole checkpoint."""
    from shardlab.testing import run_workers
    from tests.test_hf_families import _tensors, reference

    runs = run_workers(3, _sharded_loads, dirs, timeout_s=300)
    for name, strategy in SHARDED:
        ref = reference(dirs[name])
        want = _tensors(ref)
        whole = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
        for rank, run in enumerate(runs):
            state, read = run[name, strategy]
            got = {k.removeprefix("model."): v for k, v in state.items()}
            assert {k for k, _ in ref.named_parameters()} <= set(got) <= set(want), (name, strategy, rank)
            for k, v in got.items():
                assert torch.equal(v, want[k]), (name, strategy, rank, k)
            assert read < whole, (name, strategy, rank, read, whole)
        # every rank gathered the same counts: each rank's one row of 20 token positions, top 2, 3 ranks
        sections = [run["router", name] for run in runs]
        assert all(s == sections[0] for s in sections), sections
        assert [sum(c) for c in sections[0]["tokens_per_expert"]] == [3 * 2 * 20] * 2, sections[0]
        assert sections[0]["balance_micro_batches"] == 3, sections[0]
