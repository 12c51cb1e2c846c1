"""A peer's rollout in the learner's tokens: retokenized ids and chunk-level behavior log-probs.

This is what PRP needs from THL: the peer's completion text re-encoded *as a completion* by the
learner's tokenizer, and for every THL chunk the range of learner tokens it covers together with
the sum of the peer's behavior log-probs over the peer tokens of the same text. Log-probs are
only ever compared as chunk sums, which are well defined on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mutualrl.thl.align import align_encodings
from mutualrl.thl.retokenize import Encoded, encode, encode_completion

PeerChunks = list[tuple[int, int, float]]


def peer_trace(completion: str, peer_ids: Sequence[int], peer_logprobs: Sequence[float],
               source_tokenizer: Any, target_tokenizer: Any, prompt: str | Sequence[int] = ""
               ) -> tuple[list[int], PeerChunks, dict[str, float]] | None:
    """Map a peer completion onto the learner's tokenization.

    Args:
        completion: the peer's decoded completion text.
        peer_ids: the token ids the peer sampled (EOS last if it stopped on EOS).
        peer_logprobs: the peer's behavior log-prob for each of ``peer_ids``.
        source_tokenizer: the peer's tokenizer; ``target_tokenizer``: the learner's.
        prompt: the learner's prompt (text or ids) the completion is encoded after.

    Returns:
        ``(learner_ids, chunks, residual)`` where each chunk is ``(start, end, peer_logprob_sum)``
        over learner token indices ``start:end``; ``None`` if the trace cannot be used (lengths
        disagree). When the peer's sampled ids are not the canonical encoding of its text, the
        whole text becomes one chunk (a sequence-level ratio) and ``noncanonical`` is 1.
    """
    peer_ids = [int(i) for i in peer_ids]
    lps = [float(x) for x in peer_logprobs]
    if len(peer_ids) != len(lps):
        return None
    src_eos = getattr(source_tokenizer, "eos_token_id", None)
    has_eos = bool(peer_ids) and peer_ids[-1] == src_eos
    n_text = len(peer_ids) - int(has_eos)
    text_lps = lps[:n_text]
    tgt_ids, tgt_offsets = encode_completion(target_tokenizer, prompt, completion)
    residual = {"noncanonical": 0.0, "non1to1_char_frac": 0.0, "chunks": 0.0}
    chunks: PeerChunks = []
    src = encode(source_tokenizer, completion)
    if list(src.ids) == peer_ids[:n_text] and completion:
        al = align_encodings(completion, src, Encoded(completion, tgt_ids, tgt_offsets),
                             source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
        sb, tb, cb = al.source_bounds.tolist(), al.target_bounds.tolist(), al.char_bounds.tolist()
        carry = 0.0
        non11 = 0
        for k in range(len(cb) - 1):
            s = sum(text_lps[sb[k]:sb[k + 1]]) + carry
            if tb[k + 1] == tb[k]:  # no learner token here: fold into the next chunk
                carry = s
                continue
            carry = 0.0
            chunks.append((tb[k], tb[k + 1], s))
            if sb[k + 1] - sb[k] != 1 or tb[k + 1] - tb[k] != 1:
                non11 += cb[k + 1] - cb[k]
        if carry and chunks:
            a, b, s = chunks[-1]
            chunks[-1] = (a, b, s + carry)
        residual["non1to1_char_frac"] = non11 / max(1, len(completion))
    elif tgt_ids:
        chunks = [(0, len(tgt_ids), sum(text_lps))]
        residual["noncanonical"] = 1.0
        residual["non1to1_char_frac"] = 1.0
    if not tgt_ids and text_lps:
        return None
    ids = list(tgt_ids)
    if has_eos:
        tgt_eos = getattr(target_tokenizer, "eos_token_id", None)
        if tgt_eos is None:
            return None
        chunks.append((len(ids), len(ids) + 1, lps[-1]))
        ids.append(int(tgt_eos))
    residual["chunks"] = float(len(chunks))
    return ids, chunks, residual
