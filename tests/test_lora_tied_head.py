"""LoRA on an output layer tied to the input embeddings (the zoo's Llama and GPT-2 tie them): right
with the ``hf`` engine (it samples from the trained module), refused where the policy would not
sample or export what it trained: the vLLM engine (its tied head is the plain embeddings) and a
merged export (the merge adds the adapter into the shared weight, changing the embeddings too)."""

from __future__ import annotations

import copy

import pytest
import torch

from mutualrl.config import GenerationConfig, GRPOOptions, PeftConfig
from mutualrl.rollout.modeling import check_lora_head, lora_tied_head
from mutualrl.rollout.policy import Policy

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tied(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"])
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.mark.parametrize(("targets", "want"), [
    (["lm_head", "q_proj"], "lm_head"),
    (["q_proj", "v_proj"], None),
    ("all-linear", None),  # peft leaves the output layer out of all-linear
    (r".*lm_head", "lm_head"),
    (r".*\.(q_proj|v_proj)", None),
])
def test_the_tied_head_is_found_as_peft_would_match_it(tied, targets, want):
    assert lora_tied_head(tied, targets) == want


def test_an_untied_head_may_take_an_adapter(tiny_models):
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"], tie_word_embeddings=False)
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    assert lora_tied_head(untied, ["lm_head"]) is None
    check_lora_head(untied, ["lm_head"], "p", engine="vllm")


def test_a_vllm_policy_with_an_adapter_on_a_tied_head_is_refused_naming_the_field(tiny_models, tied):
    check_lora_head(tied, ["lm_head", "q_proj"], "p", engine="hf")  # the hf engine samples the trained module
    field = r"policies\[i\]\.peft\.target_modules \(policy 'v'\)"
    with pytest.raises(ValueError, match=field + r".*'lm_head'.*tie"):
        Policy("v", str(tiny_models["tiny-llama"]), GRPOOptions(), generation=GenerationConfig(engine="vllm"),
               peft=PeftConfig(r=2, lora_alpha=4, target_modules=["lm_head", "q_proj"]))


def test_a_merged_export_of_an_adapter_on_a_tied_head_is_refused(tied):
    """Merging such an adapter changes the input embeddings too: the merged model's logits are not the
    trained model's (shown here), so ``export --merge-lora`` refuses; an adapter elsewhere merges."""
    from peft import LoraConfig, get_peft_model

    from mutualrl.export.model import ExportError, _check_mergeable

    def adapted(targets):
        model = get_peft_model(copy.deepcopy(tied), LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                                task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p))
        return model

    on_head = adapted(["lm_head", "q_proj"])
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        trained = on_head(input_ids=ids).logits
        merged = copy.deepcopy(on_head).merge_and_unload()(input_ids=ids).logits
    assert (merged - trained).abs().max() > 1e-2  # why it is refused
    with pytest.raises(ExportError, match=r"'lm_head'.*without --merge-lora"):
        _check_mergeable(on_head)
    _check_mergeable(adapted(["q_proj", "v_proj"]))
