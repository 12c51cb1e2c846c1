"""What a policy needs to know of a Hugging Face model and its tokenizer, without loading the weights:
its tokenizer's identity, how it writes a prompt, which tokens end a completion, and that its
dropout is off for RL. Used for the learner's own model and, by THL, for every peer's."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from mutualrl.thl.peer import stop_ids_of


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short id of a tokenizer: class, vocabulary size and a hash of the vocabulary."""

    vocab = tokenizer.get_vocab()
    h = hashlib.sha1("\n".join(sorted(vocab)).encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{type(tokenizer).__name__}-{len(vocab)}-{h}"


def format_prompt(template: str, system_prompt: str | None, tokenizer: Any, question: str) -> str:
    """The prompt text of ``question`` under a policy's ``prompt_template`` (a format string with
    ``{question}``, or ``chat``: the tokenizer's chat template with an optional system prompt)."""
    if template == "chat":
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        msgs.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return template.format(question=question)


def generation_stop_ids(generation_config: Any) -> list[int]:
    """The ``eos_token_id`` entries of a generation config (an int, a list or none)."""
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else []


def model_stop_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """The ids a model stops on, read from its directory without loading the weights: its
    tokenizer's EOS plus its generation config's (Gemma-3: ``<end_of_turn>`` too)."""
    from transformers import AutoConfig
    from transformers import GenerationConfig as HFGenerationConfig

    try:
        gen = HFGenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        try:
            gen = HFGenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))
        except (OSError, ValueError):
            gen = None
    return stop_ids_of(tokenizer, generation_stop_ids(gen))


DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "resid_dropout")
"""Float attributes through which some architectures (Llama, Qwen2, Gemma, ...) apply dropout
functionally instead of through an ``nn.Dropout`` module."""


def disable_dropout(model: torch.nn.Module) -> int:
    """Switch every dropout of ``model`` off (TRL's ``disable_dropout``); returns how many were on.

    RL compares the trainer's log-probs with the sampler's: dropout active in the training forward
    makes them differ by chance (up to 0.15 nats at p = 0.1), which the PPO ratio then reads as a
    policy change. ``nn.Dropout`` modules get ``p = 0``; float dropout attributes of modules are set
    to 0 as well."""
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            n += module.p > 0
            module.p = 0.0
        for attr in DROPOUT_ATTRIBUTES:
            v = getattr(module, attr, None)
            if isinstance(v, float) and not isinstance(v, bool):
                n += v > 0
                setattr(module, attr, 0.0)
    return n
