"""SFT data (masking token by token, packing, bad input named by file and line, the embedded
set) and Hugging Face export (hf and gpt models, LoRA merged and adapter: equal logits)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardlab.data import sft, sft_examples  # noqa: E402
from shardlab.models.hf import HFCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    texts = [e["instruction"] + " " + e["output"] for e in sft.builtin_examples(300)]
    sft.train_tokenizer(texts, 400, str(d))
    return sft.SFTTokenizer(str(d))


def test_builtin_examples_are_built_from_the_stdlib():
    a, b = sft.builtin_examples(50), sft.builtin_examples(50)
    assert a == b and len(a) == 50
    assert all(e["instruction"].startswith("What does the Python") and len(e["output"]) >= 40 for e in a)


def test_masking_token_by_token(tokenizer):
    ex = {"instruction": "What does os.path.join do?", "input": "two paths", "output": "Join two paths."}
    ids, labels = tokenizer.encode_example(ex)
    prompt = tokenizer.encode("### Instruction:\nWhat does os.path.join do?\n\n### Input:\ntwo paths\n\n### Response:\n")
    response = tokenizer.encode("Join two paths.")
    assert ids == [tokenizer.bos_id, *prompt, *response, tokenizer.eos_id]
    assert labels == [-100] * (1 + len(prompt)) + response + [tokenizer.eos_id]
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Goodbye."}]}
    ids, labels = tokenizer.encode_example(chat)
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    # every assistant turn ends in </s>, trained: the model learns to stop after its answer
    eos = tokenizer.eos_id
    assert trained == tokenizer.encode("Hello.") + [eos] + tokenizer.encode("Goodbye.") + [eos]
    assert ids[-1] == eos and labels[-1] == eos and labels[ids.index(eos)] == eos
    assert all(lab in (-100, t) for t, lab in zip(ids, labels))
    assert ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id


def _with_template(tokenizer, tmp_path, template: str):
    """The tokenizer's files plus a chat template (chat_template.jinja, as transformers 5 saves it)."""
    tokenizer.save(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(template)
    return sft.SFTTokenizer(str(tmp_path))


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_template_with_bos_gives_one_bos_and_trains_its_end(tokenizer, tmp_path):
    tok = _with_template(tokenizer, tmp_path, TEMPLATE)
    assert tok.has_chat_template
    ids, labels = tok.encode_example({"messages": [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello."}]})
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    assert trained == tok.encode("Hello.") + [tok.eos_id]


def test_trailing_user_turn_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                    '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
                    '{"role": "user", "content": "and?"}]}\n')
    with pytest.raises(sft.SFTDataError, match="ends with a user turn") as e:
        sft_examples.read_examples(str(path))
    assert f"{path}:2" in str(e.value)


def _sft_cfg(tmp_path, *extra):
    from shardlab.config import load_config

    return load_config("configs/sft-mistral-tiny.yaml", ["parallel.strategy=single", f"output.dir={tmp_path}",
                                                         *extra])


def test_cache_key_follows_the_chat_template_and_the_tokenizer_dir(tokenizer, tmp_path, monkeypatch):
    """Editing the template re-tokenizes; a second directory with the same tokenizer files but
    another template gets its own rows and its own tokenizer directory."""
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(20)))
    a = _with_template(tokenizer, tmp_path / "a", TEMPLATE)
    b_dir = tmp_path / "b"
    tokenizer.save(str(b_dir))  # the same tokenizer files, no template
    path_a, tdir_a = sft.prepare(_sft_cfg(tmp_path, f"data.path={data}", f"data.tokenizer_path={a.directory}"))
    path_b, tdir_b = sft.prepare(_sft_cfg(tmp_path, f"data.path={data}", f"data.tokenizer_path={b_dir}"))
    assert path_a != path_b and (tdir_a, tdir_b) == (a.directory, str(b_dir))
    (tmp_path / "a" / "chat_template.jinja").write_text(TEMPLATE.replace("<|", "[").replace("|>", "]"))
    path_a2, _ = sft.prepare(_sft_cfg(tmp_path, f"data.path={data}", f"data.tokenizer_path={a.directory}"))
    assert path_a2 != path_a
    rows = [torch.load(p, weights_only=True)["train"][0][0] for p in (path_a, path_a2)]
    assert not torch.equal(rows[0], rows[1])


def test_data_report_counts_and_warns(tmp_path, monkeypatch):
    """At seq_len 40 most of these examples lose their response: said with counts, not silent."""
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": "Explain the thing " + "in detail " * (i % 3) * 8,
                                        "output": "Because " * (1 + i % 7)}) + "\n" for i in range(60)))
    from shardlab.data import build_datasets

    d = build_datasets(_sft_cfg(tmp_path, f"data.path={data}", "data.seq_len=40", "data.val_fraction=0.1"))
    info = d.info
    assert info["examples"] == 60 and info["dropped_no_response_after_truncation"] > 3
    assert info["train_rows"] + info["val_rows"] == 60 - info["dropped_no_response_after_truncation"]
    assert info["train_target_tokens"] == int((d.train.y != -100).sum())
    assert d.report[0].startswith(f"data: 60 examples from {data}: {info['dropped_no_response_after_truncation']} "
                                  f"dropped, {info['truncated']} truncated at data.seq_len=40")
    assert d.report[1].startswith("warning:") and f"longest has {info['longest_example_tokens']}" in d.report[1]


def test_rows_truncate_pad_and_pack():
    chunks = [([1, 2, 3], [-100, 5, 6]), ([7, 8], [-100, 9]), ([4, 4, 4, 4], [-100, -100, 1, 2])]
    x, y, real = sft._rows(chunks, 6, 0, packing=False)
    assert x.shape == (3, 6) and real.tolist() == [3, 2, 4]
    assert y[0].tolist() == [-100, 5, 6, -100, -100, -100]
    x, y, real = sft._rows(chunks, 6, 0, packing=True)
    assert x.shape == (2, 2, 6) and real.tolist() == [5, 4]
    assert x[0, 0].tolist() == [1, 2, 3, 7, 8, 0]
    assert x[0, 1].tolist() == [0, 1, 2, 0, 1, 0]  # positions restart per example; padding its own
    assert y[0].tolist() == [-100, 5, 6, -100, 9, -100]


@pytest.mark.parametrize("line,needle", [
    ('{"instruction": "x", "output": "y"', "not valid JSON"),
    ('{"instruction": "x", "output": ""}', "no response"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no response"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "unknown role"),
    ('{"prompt": "x"}', "neither alpaca"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, line, needle):
    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n' + line + "\n")
    with pytest.raises(sft.SFTDataError, match=needle) as e:
        sft_examples.read_examples(str(path))
    assert f"{path}:2" in str(e.value)


def test_bad_data_stops_train_before_workers(tmp_path, capsys):
    from shardlab.cli import main

    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "x"}\n')
    rc = main(["train", "configs/sft-mistral-tiny.yaml", "--nproc", "2", f"data.path={path}",
               f"output.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:2" in err and "no response" in err


def _tiny_mistral(lora=None):
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return HFCausalLM(cfg, seed=1, lora=lora)


def test_export_hf_lora_merged_and_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardlab.export_hf import export_hf

    model = _tiny_mistral({"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": None}).eval()
    with torch.no_grad():  # trained-looking adapters (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.randint(0, 50, (2, 9))
    want = model(ids)
    export_hf(model, str(tmp_path / "adapter"), lora="adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_config(model.hf_config)
    base.load_state_dict({k.removeprefix("model.base_model.model.").replace(".base_layer.", "."): v
                          for k, v in model.state_dict().items() if "lora_" not in k}, strict=False)
    got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    export_hf(model, str(tmp_path / "merged"), lora="merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_gpt_exports_as_gpt2_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from shardlab.export_hf import export_hf
    from shardlab.models import GPT, GPTConfig

    for bias in (True, False):
        model = GPT(GPTConfig(vocab_size=71, block_size=24, n_layer=2, n_head=3, n_embd=36, bias=bias), seed=4).eval()
        out = export_hf(model, str(tmp_path / f"gpt-{bias}"))
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        assert isinstance(hf, GPT2LMHeadModel)
        ids = torch.randint(0, 71, (2, 24))
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_train_then_export_cli_equal_logits(tmp_path, monkeypatch):
    """A short single-process SFT run (embedded data, run-time tokenizer, checkpoint), then
    `shardlab export RUN --format hf`: from_pretrained gives the trained model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlab.cli import main
    from shardlab.config import load_config
    from shardlab.export import load_model
    from shardlab.loop.train import train
    from tests.checkpoint_helpers import runtime

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    cfg = load_config("configs/sft-mistral-tiny.yaml", [
        "parallel.strategy=single", "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=4",
        "checkpoint.every_steps=3", f"output.dir={tmp_path}", "output.run_name=r", "output.progress=false",
        "output.tensorboard=false", "train.memory_tracking=none", "data.seq_len=64"])
    result = train(cfg, runtime(0, 1, "single"))
    assert result["tokens_processed"] < result["samples_processed"] * 64  # padding not counted
    run = tmp_path / "r"
    assert (run / "hf" / "config.json").exists() and (run / "hf" / "tokenizer.json").exists()
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    trained, _ = load_model(str(run))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("### Instruction:\nWhat does json.dumps do?\n\n### Response:\n", return_tensors="pt").input_ids
    torch.testing.assert_close(hf(input_ids=ids).logits, trained(ids), rtol=1e-5, atol=1e-5)
    at_end = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    torch.testing.assert_close(at_end(input_ids=ids).logits, trained(ids), rtol=1e-5, atol=1e-5)
    assert hf.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_config_errors():
    from shardlab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="exactly one of model.hf_path"):
        load_config(None, ["model.name=hf"])
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(None, ["model.name=hf", "model.hf_path=/nonexistent"])
    with pytest.raises(ConfigError, match="data.tokenizer_path"):
        load_config("configs/sft-mistral-tiny.yaml", ["data.tokenizer_path=/nonexistent"])
    with pytest.raises(ConfigError, match="export.lora"):
        load_config("configs/sft-mistral-tiny.yaml", ["export.lora=both"])
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config("configs/sft-mistral-tiny.yaml", ["model.lora.rank=-1"])


def test_render_sft_configs(tmp_path):
    """shardlab render works for SFT configs unchanged (the 7B one with a stand-in model directory)."""
    from shardlab.cli import main

    model_dir = tmp_path / "Mistral-7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": 32000,
                                                       "max_position_embeddings": 32768}))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (model_dir / "tokenizer.json").write_text("{}")  # pretrained weights come with their tokenizer
    data = tmp_path / "sft.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    for target in ("slurm", "k8s", "accelerate"):
        rc = main(["render", target, "configs/sft-mistral-7b.yaml", "--out", str(tmp_path / target),
                   f"model.hf_path={model_dir}", f"data.path={data}"])
        assert rc == 0, target
        assert any(p.is_file() for p in (tmp_path / target).rglob("*")), target


# -- errors before any worker starts, each naming what to fix --------------------------------------
@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    """A tiny Mistral saved by transformers (weights and config.json, vocab 50), no tokenizer."""
    d = tmp_path_factory.mktemp("pretrained")
    _tiny_mistral().hf_model.save_pretrained(d)
    return d


@pytest.mark.parametrize("targets,bad", [("[c_attn]", "['c_attn']"), ("[q_proj,qkv_proj]", "['qkv_proj']")])
def test_unknown_lora_target_lists_the_linear_layers(tmp_path, capsys, targets, bad):
    from shardlab.cli import main

    rc = main(["train", "configs/sft-mistral-tiny.yaml", "--nproc", "2", "model.lora.rank=4",
               f"model.lora.target_modules={targets}", f"output.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"model.lora.target_modules: {bad} matches no layer" in err
    assert "q_proj, up_proj, v_proj" in err and "Traceback" not in err


def test_weights_without_tokenizer_and_vocab_mismatch(pretrained_dir, tokenizer, tmp_path, capsys):
    from shardlab.cli import main

    args = ["train", "configs/sft-mistral-tiny.yaml", "model.hf_config=null", f"model.hf_path={pretrained_dir}",
            "data.seq_len=32", f"output.dir={tmp_path}"]
    assert main([*args, "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds pretrained weights but no tokenizer.json" in err and "data.tokenizer_path=" in err
    # a tokenizer of 400 tokens for a model of 50: said before any worker (or the one process) starts
    for extra in (["--nproc", "2"], ["parallel.strategy=single"]):
        assert main([*args, f"data.tokenizer_path={tokenizer.directory}", *extra]) == 2
        err = capsys.readouterr().err
        assert f"has {tokenizer.vocab_size} tokens, but the model in model.hf_path" in err and "has 50" in err
        assert "Traceback" not in err


# -- a LoRA run on a pretrained directory: export, generate, eval ---------------------------------
@pytest.fixture(scope="module")
def pretrained_with_tokenizer(tokenizer, tmp_path_factory):
    from transformers import MistralConfig

    from shardlab.models.hf import HFCausalLM

    d = tmp_path_factory.mktemp("pretrained-tok")
    cfg = MistralConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    HFCausalLM(cfg, seed=2).hf_model.save_pretrained(d)
    tokenizer.save(str(d))
    return d


def test_lora_adapter_export_names_its_base_and_generate_eval_read_it(pretrained_with_tokenizer, tmp_path, capsys,
                                                                      monkeypatch):
    """LoRA on a pretrained directory, one process: no FutureWarning; the summary and metrics count
    trainable parameters; the adapter names its base (peft's AutoPeftModel loads it); `shardlab
    generate` and `eval` take the run directory, the adapter directory and a merged export alike."""
    import warnings

    from peft import AutoPeftModelForCausalLM

    from shardlab.cli import main
    from shardlab.export import load_model

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    pre = pretrained_with_tokenizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "configs/sft-mistral-tiny.yaml", "parallel.strategy=single", "model.hf_config=null",
                     f"model.hf_path={pre}", "model.lora.rank=2", "data.seq_len=48", "train.steps=2",
                     "train.global_batch_size=4", "train.micro_batch_size=2", "checkpoint.every_steps=2",
                     "export.lora=adapter", f"output.dir={tmp_path}", "output.run_name=lora", "output.progress=false",
                     "output.tensorboard=false", "train.memory_tracking=none"]) == 0
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    run = tmp_path / "lora"
    out = capsys.readouterr().out
    assert "parameters (trainable)" in out and out.startswith("data: ")
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0 < metrics["num_trainable_parameters"] < metrics["num_parameters"] / 5
    assert json.loads((run / "hf" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(pre)
    ids = torch.randint(0, 50, (1, 9))
    want = load_model(str(run))[0](ids)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(run / "hf").eval()
    torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert main(["export", str(run), "--format", "hf", "--lora", "merged", "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    answers, losses = [], []
    for source in (run, run / "hf", tmp_path / "merged"):
        assert main(["generate", str(source), "--prompt", "What does json.dumps do?", "--chat", "--temperature", "0",
                     "--max-new-tokens", "6"]) == 0
        answers.append(capsys.readouterr().out)
        assert main(["eval", str(source)]) == 0
        losses.append(json.loads(capsys.readouterr().out)["val_loss"])
    assert answers[0] == answers[1] == answers[2] and answers[0].strip()
    assert losses == pytest.approx([metrics["val_loss"]] * 3, rel=1e-5)


def test_eval_without_a_run_config_asks_for_one(pretrained_with_tokenizer, capsys):
    from shardlab.cli import main

    assert main(["eval", str(pretrained_with_tokenizer)]) == 1
    assert "give --config CONFIG.yaml" in capsys.readouterr().err
