"""A peer's rollout in the learner's tokens: retokenized ids and chunk-level behavior log-probs.

This is what PRP needs from THL: the peer's completion text re-encoded *as a completion* by the
learner's tokenizer (after the learner's prompt), and for every THL chunk the range of learner
tokens it covers together with the sum of the peer's behavior log-probs over the peer tokens of
the same text (:meth:`~mutualrl.thl.align.Alignment.chunk_sums`). Log-probs are only ever compared
as chunk sums, which are well defined on both sides. The peer's side is encoded in the peer's own
prompt context too, so a SentencePiece dummy prefix does not make every rollout of such a peer
look non-canonical. A completion that stopped on one of the peer's stop tokens keeps that
token's log-prob in a chunk of its own, matched with the learner's EOS.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.thl.align import align_encodings
from mutualrl.thl.retokenize import Encoded, decode, encode_completion

PeerChunks = list[tuple[int, int, float]]


@dataclass(frozen=True)
class PeerTrace:
    """A peer rollout mapped onto the learner's tokenization, or why it cannot be.

    ``ids`` are the learner's tokens of the completion (its EOS last when the peer stopped);
    ``chunks`` hold ``(start, end, peer_logprob_sum)`` over learner token indices; ``residual`` is
    the THL residual of this row (``noncanonical``: the peer's sampled ids are not the canonical
    encoding of its text, so the whole text is one chunk; ``non1to1_char_frac``; ``chunks``).
    ``refused`` names why the row cannot be used (``length_mismatch``, ``unrepresentable``: the
    learner's tokenizer does not reproduce the text, e.g. an unknown token; ``no_eos``); empty
    when it can.
    """

    ids: list[int] = field(default_factory=list)
    chunks: PeerChunks = field(default_factory=list)
    residual: dict[str, float] = field(default_factory=dict)
    refused: str = ""


def stop_ids_of(tokenizer: Any, extra: Collection[int] = ()) -> frozenset[int]:
    """The token ids a model stops on: the tokenizer's EOS plus ``extra`` (its generation config's)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset(([] if eos is None else [int(eos)]) + [int(i) for i in extra])


def represents(tokenizer: Any, ids: Sequence[int], text: str) -> bool:
    """Whether ``ids`` decode back to exactly ``text`` (no unknown token, no normalisation)."""
    return decode(tokenizer, list(ids)) == text


def peer_trace(completion: str, peer_ids: Sequence[int], peer_logprobs: Sequence[float],
               source_tokenizer: Any, target_tokenizer: Any, *, prompt: str | Sequence[int] = "",
               source_prompt: str | Sequence[int] = "", source_stop_ids: Collection[int] | None = None
               ) -> PeerTrace:
    """Map a peer completion onto the learner's tokenization.

    Args:
        completion: the peer's decoded completion text.
        peer_ids: the token ids the peer sampled (its stop token last if it stopped on one).
        peer_logprobs: the peer's behavior log-prob for each of ``peer_ids``.
        source_tokenizer: the peer's tokenizer; ``target_tokenizer``: the learner's.
        prompt: the learner's prompt (text or ids) the completion is encoded after.
        source_prompt: the peer's own prompt (text or ids), the context of its side's encoding.
        source_stop_ids: the ids the peer stops on (default: its tokenizer's EOS).
    """
    peer_ids = [int(i) for i in peer_ids]
    lps = [float(x) for x in peer_logprobs]
    if len(peer_ids) != len(lps):
        return PeerTrace(refused="length_mismatch")
    stops = stop_ids_of(source_tokenizer) if source_stop_ids is None else frozenset(source_stop_ids)
    stopped = bool(peer_ids) and peer_ids[-1] in stops
    n_text = len(peer_ids) - int(stopped)
    text_lps = lps[:n_text]
    tgt_ids, tgt_offsets = encode_completion(target_tokenizer, prompt, completion)
    if not represents(target_tokenizer, tgt_ids, completion) or (text_lps and not tgt_ids):
        return PeerTrace(refused="unrepresentable")
    src_ids, src_offsets = encode_completion(source_tokenizer, source_prompt, completion)
    if completion and src_ids == peer_ids[:n_text]:
        al = align_encodings(completion, Encoded(completion, src_ids, src_offsets),
                             Encoded(completion, tgt_ids, tgt_offsets),
                             source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
        chunks = _learner_chunks(al.target_bounds.tolist(), al.chunk_sums(text_lps, "source").tolist())
        residual = {"noncanonical": 0.0, "non1to1_char_frac": al.residual.non_1to1_char_frac}
    elif tgt_ids:
        chunks = [(0, len(tgt_ids), sum(text_lps))]
        residual = {"noncanonical": 1.0, "non1to1_char_frac": 1.0}
    else:
        chunks, residual = [], {"noncanonical": 0.0, "non1to1_char_frac": 0.0}
    ids = list(tgt_ids)
    if stopped:
        tgt_eos = getattr(target_tokenizer, "eos_token_id", None)
        if tgt_eos is None:
            return PeerTrace(refused="no_eos")
        chunks.append((len(ids), len(ids) + 1, lps[-1]))
        ids.append(int(tgt_eos))
    residual["chunks"] = float(len(chunks))
    return PeerTrace(ids, chunks, residual)


def _learner_chunks(target_bounds: list[int], sums: list[float]) -> PeerChunks:
    """``(start, end, sum)`` per chunk with learner tokens; a chunk without any (a learner that
    skips some text) folds its sum into the next chunk, or the last one at the end."""
    chunks: PeerChunks = []
    carry = 0.0
    for k, s in enumerate(sums):
        a, b = target_bounds[k], target_bounds[k + 1]
        if a == b:
            carry += s
            continue
        chunks.append((a, b, s + carry))
        carry = 0.0
    if carry and chunks:
        a, b, s = chunks[-1]
        chunks[-1] = (a, b, s + carry)
    return chunks
