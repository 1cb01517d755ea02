#!/usr/bin/env python3
"""Make a tiny model for a real vLLM, with nothing downloaded (HF_HUB_OFFLINE=1 is fine).

    python tests/realengine/make_model.py DIR

Run it with the vLLM virtual environment's python (it needs `tokenizers`, `numpy`, `safetensors`).
Writes, the same bytes on every run:
  DIR/model/config.json              a tiny Llama (2 layers, hidden 128, 2 heads of 64)
  DIR/model/tokenizer.json           a byte-level BPE trained here on host/tokenize/testdata/prose.txt,
                                     with the special tokens of Llama 3 and ChatML chat templates
  DIR/model/tokenizer_config.json    bos/eos and a Llama-3-like chat template with tools
  DIR/lora/adapter_config.json       a random PEFT LoRA adapter (r 8, q_proj/v_proj)
  DIR/lora/adapter_model.safetensors
`vllm serve DIR/model --load-format dummy` fills random weights; the output text is noise, the
tokenization, chat rendering, scheduling, prefix caching and KV events are the real engine's.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROSE = os.path.join(HERE, "..", "..", "host", "tokenize", "testdata", "prose.txt")

BOS = "<|begin_of_text|>"
EOS = "<|eot_id|>"
SPECIAL = [
    BOS,
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOS,
    "<|eom_id|>",
    "<|python_tag|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<s>",
    "</s>",
    "<unk>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|end_of_text|>",
]
VOCAB = 2048

# Llama 3.x's layout (header ids, eot) with tools in the system turn, kept simple enough that the
# engine and the router must agree on every construct it uses: loops, tojson, tool calls, tool
# results, add_generation_prompt, a template kwarg (`reasoning`), content as a string or parts.
CHAT_TEMPLATE = """{{- bos_token }}
{%- if reasoning is defined and reasoning %}<|start_header_id|>system<|end_header_id|>\n\nreasoning: on<|eot_id|>{% endif %}
{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('Unknown role: ' ~ message['role']) }}{% endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['content'] is string %}{{ message['content'] }}
{%- elif message['content'] is not none %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}
{%- if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif %}
{%- if not (loop.last and message['role'] == 'assistant' and not add_generation_prompt) %}{{ '<|eot_id|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    with open(PROSE, encoding="utf-8") as f:
        text = f.read()
    # A little non-ASCII so such prompts are not all single bytes.
    extra = ["café naïve résumé Zürich São Paulo", "日本語のテキスト 東京 京都", "Привет мир", "emoji 🙂 ✓"]
    corpus = [p for p in text.split("\n\n") if p.strip()] + extra * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(dict.fromkeys(SPECIAL)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write(path, data):
    with open(path, "w", encoding="utf-8") as f:
        f.write(data)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = os.path.abspath(sys.argv[1])
    model = os.path.join(out, "model")
    lora = os.path.join(out, "lora")
    os.makedirs(model, exist_ok=True)
    os.makedirs(lora, exist_ok=True)

    tok = train_tokenizer()
    tok.save(os.path.join(model, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": vocab,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    write(os.path.join(model, "config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")
    tconfig = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    write(os.path.join(model, "tokenizer_config.json"), json.dumps(tconfig, indent=2, sort_keys=True) + "\n")

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.RandomState(34)
    r, hidden, layers = 8, config["hidden_size"], config["num_hidden_layers"]
    tensors = {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = (rng.standard_normal((r, hidden)) * 0.02).astype(np.float32)
            tensors[f"{base}.lora_B.weight"] = (rng.standard_normal((hidden, r)) * 0.02).astype(np.float32)
    save_file(tensors, os.path.join(lora, "adapter_model.safetensors"))
    adapter = {
        "base_model_name_or_path": model,
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
    }
    write(os.path.join(lora, "adapter_config.json"), json.dumps(adapter, indent=2, sort_keys=True) + "\n")
    print(out)


if __name__ == "__main__":
    main()
