"""Train as you infer: an SFT run on a user's tokenizer with a chat template of its own, exported,
answers in plain transformers exactly as `shardlab generate` answers, and the ids it trained on are
`apply_chat_template`'s, BOS included exactly when the template renders it. The user's tokenizer.json
is used as written even where config.json's model type names a transformers class that would rebuild
it (Qwen2Tokenizer replaces a ByteLevel pre-tokenizer with its own split and NFC)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytest.importorskip("transformers")

from shardlab.data import sft  # noqa: E402

WORDS = "red green blue quiet loud day night cat dog sun rain tree river stone apple cafe".split()
TEMPLATES = {
    # renders no BOS (Phi-3, Granite, Qwen2 style)
    "no-bos": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    # renders its BOS first (Llama style)
    "bos": ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}"),
}


def _conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 4))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + i % 3)) + "."
        out.append({"messages": [{"role": "user", "content": f"Which {q}?"}, {"role": "assistant", "content": a}]})
    return out


def user_tokenizer(path, template: str) -> str:
    """A BPE tokenizer.json of the user's (ByteLevel), a tokenizer_config.json that names Qwen2's
    class, BOS and EOS, and a chat template."""
    texts = [m["content"] for c in _conversations(64) for m in c["messages"]] + ["Ünïcode café 123 4567 don't"] * 8
    sft.train_tokenizer(texts, 400, str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": template}))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(path)


def test_tokenizer_json_is_used_as_written(tmp_path):
    from tokenizers import Tokenizer

    d = user_tokenizer(tmp_path, TEMPLATES["no-bos"])
    raw = Tokenizer.from_file(f"{d}/tokenizer.json")
    tok = sft.SFTTokenizer(d)
    for text in ["Hello   world,\u00e9 café 123 4567 don't", "red  green\n\nblue 99"]:
        assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert "as written" in tok.describe()


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_trained_ids_are_apply_chat_template_ids(tmp_path, kind):
    from transformers import AutoTokenizer

    d = user_tokenizer(tmp_path / "tok", TEMPLATES[kind])
    tok = sft.SFTTokenizer(d)
    tok.save(str(tmp_path / "export"))
    plain = AutoTokenizer.from_pretrained(tmp_path / "export")
    for conv in _conversations(12):
        ids, labels = tok.encode_example(conv)
        expected = plain.apply_chat_template(conv["messages"], tokenize=True)["input_ids"]
        assert ids == list(expected)
        assert (ids[0] == tok.bos_id) == (kind == "bos")
        trained = [t for t, lab in zip(ids, labels) if lab != -100]
        answer = conv["messages"][1]["content"]
        assert tok.tok.decode(trained, skip_special_tokens=True).strip() == answer
        assert trained[-1] == tok.eos_id or kind == "no-bos"  # the end of the turn is trained


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_exported_model_answers_as_shardlab_generate(tmp_path, monkeypatch, kind):
    """Train a tiny Qwen2 a few steps on the user's tokenizer, export, and ask both ways (greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlab.cli import main
    from shardlab.config import load_config
    from shardlab.loop.train import train
    from tests.checkpoint_helpers import runtime

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    d = user_tokenizer(tmp_path / "tok", TEMPLATES[kind])
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(48)))
    model_cfg = tmp_path / "qwen2.json"
    model_cfg.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 400, "hidden_size": 32,
                                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 128,
                                     "tie_word_embeddings": True}))
    cfg = load_config("configs/sft-mistral-tiny.yaml", [
        "parallel.strategy=single", f"model.hf_config={model_cfg}", f"data.path={data}", f"data.tokenizer_path={d}",
        "train.steps=12", "train.global_batch_size=8", "train.micro_batch_size=8", "train.lr=1e-2",
        f"output.dir={tmp_path}", "output.run_name=r", "output.progress=false", "output.tensorboard=false",
        "train.memory_tracking=none", "data.seq_len=48", "train.eval_every=0"])
    train(cfg, runtime(0, 1, "single"))
    export = tmp_path / "r" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    plain = AutoTokenizer.from_pretrained(export)
    for conv in _conversations(4):
        question = conv["messages"][0]["content"]
        ids = plain.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, eos_token_id=plain.eos_token_id, pad_token_id=plain.pad_token_id)
        expected = plain.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["generate", str(export), "--chat", "--prompt", question, "--max-new-tokens", "8",
                         "--temperature", "0"]) == 0
        assert printed.getvalue().strip() == expected.strip()
    if kind != "bos":
        return
    # `shardlab eval RUN/hf` is transformers' loss on the export over the same validation rows (one
    # template is enough: the path does not depend on it)
    from tests.moe_cli_check import transformers_loss

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["eval", str(export)]) == 0
    loss = json.loads(printed.getvalue().strip().splitlines()[-1])["val_loss"]
    assert loss == pytest.approx(transformers_loss(str(export)), rel=1e-6, abs=0)
