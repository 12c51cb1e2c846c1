"""What a policy needs to know of a Hugging Face model and its tokenizer, without loading the weights:
its tokenizer's identity, how it writes a prompt, which tokens end a completion, and that its
dropout is off for RL. Used for the learner's own model and, by THL, for every peer's."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
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


def _peft_targets(name: str, target_modules: Iterable[str] | str) -> bool:
    """Whether peft's ``target_modules`` adapts the module called ``name``, as peft matches them: a
    list by the module's name or a dotted suffix of it, a string as a regex over the whole name
    (``all-linear`` adapts every linear layer except the output layer)."""
    if isinstance(target_modules, str):
        return target_modules != "all-linear" and re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


def lora_tied_head(model: torch.nn.Module, target_modules: Iterable[str] | str) -> str | None:
    """The name of ``model``'s output layer (``lm_head``) where ``target_modules`` adapts it while the
    model ties it to its input embeddings (``tie_word_embeddings``, or one weight), else None.

    Training is right there (the shared weight is frozen; the adapter acts on the head's output
    only), but anything that merges the adapter into the weight changes the input embeddings too
    (peft's ``merge_and_unload``: the merged model is not the trained one), and vLLM, which loads a
    tied head from the embeddings, samples without the head's adapter."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or emb is None:
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    weight = getattr(head, "weight", None)
    shared = weight is not None and weight is getattr(emb, "weight", None)
    tied = bool(getattr(text, "tie_word_embeddings", False)) or shared
    if not tied:
        return None
    name = next((n for n, m in model.named_modules() if m is head), "lm_head")
    return name if _peft_targets(name, target_modules) else None


def tied_head_message(name: str, target_modules: Iterable[str] | str, policy: str, why: str) -> str:
    """The start of a refusal of LoRA on a tied output layer ``name`` (see :func:`lora_tied_head`),
    ending with ``why``; the caller adds the fix."""
    targets = target_modules if isinstance(target_modules, str) else sorted(target_modules)
    who = f" (policy {policy!r})" if policy else ""
    return (f"policies[i].peft.target_modules{who} = {targets!r} adapts the output layer {name!r}, which "
            f"this model ties to its input embeddings (tie_word_embeddings): {why}")


def check_lora_head(model: torch.nn.Module, target_modules: Iterable[str] | str, policy: str = "", *,
                    engine: str = "hf") -> None:
    """Refuse LoRA on an output layer that ``model`` ties to its input embeddings where the policy
    would not sample what it trains: with the vLLM engine (``engine``), whose tied head is the
    plain embeddings, so the head's adapter is never applied. (The ``hf`` engine samples from the
    trained module itself; merging such an adapter is refused by ``mutualrl export --merge-lora``.)

    Raises:
        ValueError: naming ``policies[i].peft.target_modules`` and the fix.
    """
    name = lora_tied_head(model, target_modules)
    if name is not None and engine == "vllm":
        why = ("generation.engine vllm loads a tied head from the embeddings, so it would sample without "
               "the head's adapter")
        raise ValueError(tied_head_message(name, target_modules, policy, why)
                         + f". Leave {name!r} out of target_modules (all-linear skips it; or name the "
                           "attention and MLP projections), or use generation.engine hf")
