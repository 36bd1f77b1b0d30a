"""A tiny Llama that SGLang serves on CPU with ``--load-format dummy`` (no download).

``write_model_dir(path)`` writes ``config.json`` (2 layers, hidden 64, vocab 512: the shape of
``shared/sglang-cpu.md``), a byte-level BPE ``tokenizer.json`` trained here on a fixed text with
the ``tokenizers`` library, and ``tokenizer_config.json`` with a chat template. Dummy weights are
deterministic, so every engine serving this directory gives the same outputs.

    python tests/integration/sglang_cpu/tiny_model.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 (config's bos 1, eos 2)

_CORPUS = """
An agent reads the repository, plans a change, edits a file and runs the tests. When the tests
fail it reads the error, forks a sub-agent to search the code, and compacts its context once the
history grows too long. Prefill computes the prompt; decode produces one token per iteration.
The router sends each request to the node with the smallest predicted time to first token.
<|system|> <|user|> <|assistant|> <|tool|> You are a helpful assistant. Hello, how are you?
def main(argv): return 0 # comment 0123456789 {"key": [1, 2, 3]} SELECT * FROM t WHERE x = 1;
"""


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"], special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    assert tok.get_vocab_size() <= CONFIG["vocab_size"], tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_model_dir(path: str | Path) -> Path:
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG, indent=1))
    build_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": CONFIG["max_position_embeddings"],
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}))
    return d


if __name__ == "__main__":
    print(write_model_dir(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
