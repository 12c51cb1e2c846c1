"""THL -- the Tokenizer Heterogeneity Layer.

Retokenizes a peer's text for the learner's tokenizer and aligns token-level traces (log-probs,
per-token values) between two tokenizations through chunks of text both cover in whole tokens;
measures what the alignment cannot preserve (the *residual*). See ``docs/thl.md``.
"""

from mutualrl.thl.align import (
    Alignment,
    Chunk,
    align,
    align_batch,
    align_encodings,
    align_encodings_batch,
    project_batch,
)
from mutualrl.thl.residual import PairReport, Residual, lost_spans, pair_report
from mutualrl.thl.retokenize import (
    Encoded,
    decode,
    encode,
    encode_batch,
    encode_completion,
    encode_prompt,
    offsets_by_decoding,
)

__all__ = [
    "Alignment",
    "Chunk",
    "Encoded",
    "PairReport",
    "Residual",
    "align",
    "align_batch",
    "align_encodings",
    "align_encodings_batch",
    "decode",
    "encode",
    "encode_batch",
    "encode_completion",
    "encode_prompt",
    "lost_spans",
    "offsets_by_decoding",
    "pair_report",
    "project_batch",
]
