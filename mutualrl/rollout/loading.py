"""Loading a policy's causal LM for training: tokenizer, fp32 weights on the device, dropout off, the
stop and pad tokens, gradient checkpointing and (with ``peft``) the LoRA wrapper."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mutualrl.config import PeftConfig
from mutualrl.rollout.modeling import check_lora_head, disable_dropout, generation_stop_ids
from mutualrl.thl.peer import stop_ids_of


class LoadedLM(NamedTuple):
    """What :func:`load_lm` returns."""

    tokenizer: Any
    model: torch.nn.Module
    """The model to train (the peft wrapper under LoRA)."""
    eos_ids: set[int]
    """Every token that ends a completion (the tokenizer's EOS and the generation config's stops)."""
    pad_id: int
    """The tokenizer's pad token, else its EOS."""


def load_lm(model_path: str, device: torch.device, *, gradient_checkpointing: bool = False,
            peft: PeftConfig | None = None, name: str = "", engine: str = "hf") -> LoadedLM:
    """Load ``model_path`` (a directory or hub id) for training on ``device``. ``name`` and ``engine``
    (the sampler's) are what a refused LoRA head names."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.config.use_cache = True
    disable_dropout(model)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {model_path!r} has no EOS token; generation could never stop")
    eos_ids = set(stop_ids_of(tok, generation_stop_ids(getattr(model, "generation_config", None))))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if gradient_checkpointing:  # transformers >= 5.20 renamed it
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if peft is not None:
        from peft import LoraConfig, get_peft_model

        check_lora_head(model, peft.target_modules, name, engine=engine)
        model = get_peft_model(model, LoraConfig(r=peft.r, lora_alpha=peft.lora_alpha, lora_dropout=peft.lora_dropout,
                                                 target_modules=peft.target_modules, task_type="CAUSAL_LM"))
    return LoadedLM(tok, model, eos_ids, pad_id)
