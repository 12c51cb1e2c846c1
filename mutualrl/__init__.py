"""mutualrl: Mutual Reinforcement Learning for heterogeneous language-model policies.

Several policies of different families (architectures, sizes, tokenizers) are post-trained at
the same time with GRPO and share typed experience through an exchange (SEE), a tokenizer
heterogeneity layer (THL) and a sharing strategy (PRP, XGRPO, SGT).
"""

__version__ = "0.1.0"
