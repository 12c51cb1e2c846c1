"""The policy zoo: small, genuinely heterogeneous causal LMs built locally (the embedded default).

Each zoo policy has its own architecture family (GPT-2, Llama, GPT-NeoX, Qwen2 from
``transformers`` configs), its own tokenizer *algorithm* trained on the task text (byte-level BPE,
Unigram, character level; see :mod:`mutualrl.zoo.tokenizers`) and its own vocabulary size. A
supervised warm start that stops once every skill is inside its band gives each one partial,
complementary skill (e.g. 30-50 % on addition and 3-15 % on subtraction, or the reverse), which
is what mutual training then has to share. A config refers to one as ``model: zoo:<name>`` (or
``zoo:<name>@<build seed>``).

Modules: :mod:`~mutualrl.zoo.specs` (what a policy is), :mod:`~mutualrl.zoo.task` (the task),
:mod:`~mutualrl.zoo.models` (architectures), :mod:`~mutualrl.zoo.sft` (the warm start's phases),
:mod:`~mutualrl.zoo.steps` (its data and optimizer steps), :mod:`~mutualrl.zoo.stall` (when a phase
has stalled), :mod:`~mutualrl.zoo.evaluate` (accuracy), :mod:`~mutualrl.zoo.build` (cache and cards),
:mod:`~mutualrl.zoo.cli` (``mutualrl zoo``).
"""

from mutualrl.zoo.build import build_zoo, cache_root, is_built, load_card, policy_dir, zoo_model_dir
from mutualrl.zoo.cli import register
from mutualrl.zoo.models import build_model, build_tiny_models
from mutualrl.zoo.specs import ARCHS, DEFAULT_NAMES, ZOO, ZOO_VERSION, ZooSpec
from mutualrl.zoo.task import PROMPT_TEMPLATE, default_task, format_prompt

__all__ = [
    "ARCHS", "DEFAULT_NAMES", "PROMPT_TEMPLATE", "ZOO", "ZOO_VERSION", "ZooSpec", "build_model", "build_tiny_models",
    "build_zoo", "cache_root", "default_task", "format_prompt", "is_built", "load_card", "policy_dir", "register",
    "zoo_model_dir",
]
