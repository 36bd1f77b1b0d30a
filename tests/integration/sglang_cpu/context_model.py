"""A tiny Llama whose output depends on its context: the model of the engine-patch tests.

SGLang's ``--load-format dummy`` draws every weight, norms included, from U(±1e-3): attention's
share of the residual stream vanishes and a greedy decode is the same whatever KV the engine
attends to (right, another prompt's, zeroed, none), so an "outputs are equal" assert on such a
model cannot fail. This model has the usual scale instead: every matrix N(0, 0.02), every norm
weight 1, written as ``model.safetensors`` (float32) at test time from a fixed seed; the tests
check that two prompts differing only in their prefix give different outputs before they trust
an equality.

``write_context_model_dir(path)`` writes the config and tokenizer of :mod:`tiny_model` (dtype
float32, so that a prefix computed in one pass or loaded from a cache gives the same greedy
tokens) and the weights; the weights are written by the SGLang venv's interpreter (it has torch
and safetensors; the project's venv needs neither).

    python tests/integration/sglang_cpu/context_model.py DIR   # in the SGLang venv
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SEED = 20261202
STD = 0.02


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of SGLang's / transformers' ``LlamaForCausalLM`` for ``cfg``."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                       "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (nh * d, h),
                    p + "self_attn.k_proj.weight": (nkv * d, h),
                    p + "self_attn.v_proj.weight": (nkv * d, h),
                    p + "self_attn.o_proj.weight": (h, nh * d),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def write_weights(d: Path) -> Path:
    """``model.safetensors`` for ``d/config.json`` (runs where torch and safetensors are)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((d / "config.json").read_text())
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in sorted(weight_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * STD
    path = d / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_context_model_dir(path: str | Path, python: str | Path) -> Path:
    """The model directory (``python``: an interpreter with torch and safetensors)."""
    from tiny_model import CONFIG, write_model_dir

    d = write_model_dir(path)
    (d / "config.json").write_text(json.dumps({**CONFIG, "torch_dtype": "float32"}, indent=1))
    subprocess.run([str(python), __file__, str(d)], check=True, timeout=300)
    return d


if __name__ == "__main__":
    print(write_weights(Path(sys.argv[1])))
