"""Generation engines behind one interface: ``hf`` (default) and ``vllm``."""

from mutualrl.rollout.engines.base import Generation, GenerationEngine, SamplingParams, dedupe_prompts
from mutualrl.rollout.engines.hf import HFEngine

__all__ = ["Generation", "GenerationEngine", "HFEngine", "SamplingParams", "dedupe_prompts"]
