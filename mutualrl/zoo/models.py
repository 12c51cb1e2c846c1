"""Zoo model construction: a fresh causal LM of a spec's architecture sized for its tokenizer."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from mutualrl.errors import UserError
from mutualrl.zoo.specs import ARCHS, ZOO, ZooSpec
from mutualrl.zoo.task import default_task


def build_model(spec: ZooSpec, tokenizer: Any):
    """A freshly initialised causal LM for ``spec`` with ``tokenizer``'s size and special ids."""
    import transformers as tf

    common = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    inner = spec.n_inner or 4 * spec.n_embd
    if spec.arch == "gpt2":
        cfg = tf.GPT2Config(n_positions=spec.max_positions, n_embd=spec.n_embd,
                            n_layer=spec.n_layer, n_head=spec.n_head, n_inner=inner,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif spec.arch in ("llama", "qwen2"):
        cls_cfg, cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if spec.arch == "llama"
                        else (tf.Qwen2Config, tf.Qwen2ForCausalLM))
        cfg = cls_cfg(hidden_size=spec.n_embd, intermediate_size=inner,
                      num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                      num_key_value_heads=spec.n_kv_head or spec.n_head,
                      max_position_embeddings=spec.max_positions, tie_word_embeddings=True,
                      **common)
        model = cls(cfg)
    elif spec.arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=spec.n_embd, intermediate_size=inner,
                               num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                               max_position_embeddings=spec.max_positions, rotary_pct=0.5,
                               use_parallel_residual=True, hidden_dropout=0.0,
                               attention_dropout=0.0, tie_word_embeddings=False, **common)
        model = tf.GPTNeoXForCausalLM(cfg)
    else:
        raise UserError(f"unknown zoo architecture {spec.arch!r}; valid: {', '.join(ARCHS)}")
    model.generation_config.update(bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)
    return model


def build_tiny_models(root: str | os.PathLike[str]) -> dict[str, Path]:
    """Untrained, very small zoo-family models for tests and fault benchmarks (seconds to build).

    ``{"tiny-gpt2": dir (GPT-2, byte-level BPE), "tiny-llama": dir (Llama, Unigram), "tiny-llama-32":
    dir (Llama, Unigram, 32-dim heads: a size vLLM's CPU kernels take)}`` under ``root``; a directory
    that already holds a model is reused.
    """

    from mutualrl.zoo.tokenizers import train_tokenizer

    root = Path(root)
    torch.manual_seed(0)
    task = default_task(seed=0, test_size=50, train_size=500)
    texts = [p.question + " Answer: " + p.answer for p in task.problems("train")]
    out = {}
    for name, zoo_name, kind, extra in [("tiny-gpt2", "gpt2-add", "byte_bpe", {}),
                                        ("tiny-llama", "llama-sub", "unigram", {"n_kv_head": 1}),
                                        ("tiny-llama-32", "llama-sub", "unigram",
                                         {"n_kv_head": 1, "n_embd": 64, "n_inner": 128})]:
        d = root / name
        if not (d / "config.json").is_file():
            spec = dataclasses.replace(ZOO[zoo_name], **{"n_layer": 1, "n_embd": 32, "n_head": 2, "n_inner": 64,
                                                          **extra})
            tok = train_tokenizer(kind, texts, spec.vocab_size)
            build_model(spec, tok).save_pretrained(d)
            tok.save_pretrained(d)
        out[name] = d
    return out
