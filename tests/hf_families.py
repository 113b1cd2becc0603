"""The decoder families shardlab proves against transformers (tests/test_hf_families.py), one line
each: family -> its model_type, the tiny config's own keys (soft-caps, multipliers and windows set
so that they change the logits) and the chat style of its template.

Every family is written as a complete Hugging Face directory (`write_family`): tiny random
weights (`save_pretrained`, safetensors, initializer_range 0.2 so that logits are of order 1), its
own small byte-level BPE tokenizer (trained here with `tokenizers`) with the style's special tokens
(ids 0, 1, 2 = pad, bos, eos, as the config says) and a chat template in the family's style (some
render BOS, some not). Other checks reuse the directories: `write_family(name, dir)` gives what
`model.hf_path` takes, and `FAMILIES[name].chat` says whether the template renders BOS.

The sweep's verify at 3 ranks and its "the ids an SFT run trains on equal `apply_chat_template`'s"
start from `write_family(name, dir)` and the `Family` fields (`lora_targets`: which Linears verify's
LoRA mode adapts).

A family that fails a check for a reason shardlab cannot fix is left out with its one-line reason
in SKIPPED (and docs/sft.md), never with a looser tolerance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

VOCAB = 320
DTYPE = "float64"
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
    pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Chat:
    """A chat template style: its special tokens and its Jinja template (written for these tests
    in the style each family's own template has)."""

    bos: str
    eos: str
    extra: tuple[str, ...]
    template: str

    @property
    def renders_bos(self) -> bool:
        return "bos_token" in self.template


GEN = "{% if add_generation_prompt %}"
CHATS = {
    "llama3": Chat("<|begin_of_text|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>"),
                   "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}" + GEN
                   + "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": Chat("<s>", "</s>", ("[INST]", "[/INST]"),
                    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                    "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "chatml": Chat("<|endoftext|>", "<|im_end|>", ("<|im_start|>",),
                   "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   + GEN + "<|im_start|>assistant\n{% endif %}"),
    "gemma": Chat("<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>"),
                  "{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}" + GEN + "<start_of_turn>model\n{% endif %}"),
    "tulu": Chat("<s>", "<|endoftext|>", ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
                 "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 + GEN + "<|assistant|>\n{% endif %}"),
    "granite": Chat("<|start_of_text|>", "<|end_of_text|>", ("<|start_of_role|>", "<|end_of_role|>"),
                    "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
                    "<|end_of_text|>\n{% endfor %}" + GEN + "<|start_of_role|>assistant<|end_of_role|>{% endif %}"),
    "cohere": Chat("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", ("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
                                                           "<|CHATBOT_TOKEN|>"),
                   "{{ bos_token }}{% for m in messages %}<|START_OF_TURN_TOKEN|>"
                   "{{ '<|USER_TOKEN|>' if m['role'] == 'user' else '<|CHATBOT_TOKEN|>' }}{{ m['content'] }}"
                   "<|END_OF_TURN_TOKEN|>{% endfor %}" + GEN + "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"),
    "plain": Chat("<|bos|>", "<|endoftext|>", ("<|user|>", "<|assistant|>"),
                  "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                  + GEN + "<|assistant|>\n{% endif %}"),
}


@dataclass(frozen=True)
class Family:
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)  # the family's keys over COMMON
    chat: str = "chatml"                                    # a key of CHATS
    attention: tuple[str, ...] = ("eager", "sdpa")          # the implementations the sweep runs
    # verify's LoRA mode adapts every Linear of the decoder ("all"), or shardlab's default targets
    # ("default": a family where "all" would reach fused expert parameters, which is refused)
    lora_targets: str = "all"


NO_DROPOUT = dict(attention_dropout=0.0, hidden_dropout=0.0)
GEMMA_HEAD = dict(head_dim=8, query_pre_attn_scalar=8)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.25)
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", dict(rope_theta=500.0), chat="llama3"),
    "mistral": Family("mistral", dict(sliding_window=5), chat="mistral"),
    "qwen2": Family("qwen2", dict(use_sliding_window=False)),
    "qwen3": Family("qwen3", dict(head_dim=8)),
    "gemma": Family("gemma", dict(head_dim=8), chat="gemma"),
    # transformers 5.24 refuses sdpa for Gemma 2 (soft-capping needs eager)
    "gemma2": Family("gemma2", dict(GEMMA_HEAD, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                    sliding_window=5), chat="gemma", attention=("eager",)),
    "gemma3_text": Family("gemma3_text", dict(GEMMA_HEAD, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                              sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                              rope_local_base_freq=100.0), chat="gemma"),
    "phi3": Family("phi3", dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0), chat="tulu"),
    "olmo2": Family("olmo2", {}, chat="tulu"),
    "granite": Family("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                      logits_scaling=2.0), chat="granite"),
    "cohere": Family("cohere", dict(logit_scale=0.5, use_qk_norm=True), chat="cohere"),
    "starcoder2": Family("starcoder2", dict(sliding_window=5, residual_dropout=0.0, embedding_dropout=0.0),
                         chat="plain"),
    "stablelm": Family("stablelm", dict(NO_DROPOUT, qk_layernorm=True, use_qkv_bias=True), chat="plain"),
    "gpt2": Family("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0), chat="plain"),
    "gpt_neox": Family("gpt_neox", dict(NO_DROPOUT, rotary_pct=0.5), chat="plain"),
    "falcon": Family("falcon", dict(NO_DROPOUT, new_decoder_architecture=True, num_kv_heads=2), chat="plain",
                     ),
    "opt": Family("opt", dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0, layerdrop=0.0), chat="plain"),
    "gpt_bigcode": Family("gpt_bigcode", dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64,
                                              multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                          chat="plain"),
    "nemotron": Family("nemotron", dict(partial_rotary_factor=0.5, head_dim=8), chat="plain"),
    "bloom": Family("bloom", dict(n_layer=2, n_head=4), chat="plain", attention=("eager",)),
    # mixtures of experts, written in the Hub's layout (one tensor per expert: save_pretrained's),
    # with the router's auxiliary loss on where the family has one (check 7: .loss includes it)
    "mixtral": Family("mixtral", dict(MOE, num_local_experts=4), chat="mistral"),
    "qwen2_moe": Family("qwen2_moe", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32, use_sliding_window=False)),
    "qwen3_moe": Family("qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32, head_dim=8)),
    "olmoe": Family("olmoe", dict(MOE, num_experts=4), chat="tulu"),
    # MLA attention (keys for every head, as DeepSeek ships it) and a dense first layer; no router loss in transformers
    "deepseek_v3": Family("deepseek_v3", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                              v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                                              n_shared_experts=1), chat="plain",
                          # down_proj, gate_proj and up_proj name Linears and fused experts alike (docs/sft.md)
                          lora_targets="default"),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# family -> why it is not in the sweep (one line each; docs/sft.md lists them too)
SKIPPED: dict[str, str] = {
    "bloom": "packing is refused (its ALiBi bias is built from a 2-D mask; it takes no 4-D one), and every check "
             "here runs packed rows; unpacked, its loss equals transformers' (tests/test_hf_moe.py)",
}


def hf_config(name: str):
    from transformers import AutoConfig

    fam = FAMILIES[name]
    return AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.config})


def train_tokenizer(name: str, out_dir: str):
    """A byte-level BPE of VOCAB tokens with the family's chat specials (pad, bos, eos = ids 0, 1,
    2), its chat template, saved with transformers (tokenizer.json, tokenizer_config.json,
    chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chat = CHATS[FAMILIES[name].chat]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", chat.bos, chat.eos, *chat.extra]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token=chat.bos, eos_token=chat.eos,
                                   additional_special_tokens=list(chat.extra))
    fast.chat_template = chat.template
    fast.save_pretrained(out_dir)
    return fast


CORPUS = [f"{a} {b} {c}." for a in ("What does", "Explain how", "Return the", "the value of", "Add")
          for b in ("json.dumps", "os.path.join", "a list", "two numbers", "the string")
          for c in ("do", "in Python", "with a key", "and print it", "quickly")]


def write_family(name: str, out_dir: str, seed: int = 0) -> str:
    """A Hugging Face directory for family `name`: random weights of order-1 logits
    (save_pretrained, safetensors), its tokenizer and chat template. Returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), dtype=getattr(torch, DTYPE))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    train_tokenizer(name, out_dir)
    return out_dir
