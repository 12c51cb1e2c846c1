"""The chunks in which one policy scores another's completion (``distill``'s peer scores).

A scorer (the teacher) re-encodes a student's completion with its own tokenizer, after its own
prompt, and sums its log-probs over the THL chunks of the two tokenizations; the student gets
its own log-prob sums over the same chunks from its sampled tokens. Only chunk sums are compared,
never single tokens across vocabularies: a number one tokenizer splits into digits and the other
keeps whole is one chunk on both sides, whatever the split.

Both sides compute the chunking with :func:`score_chunks` from the same inputs (the completion
text, the student's sampled ids, both tokenizers, both prompt texts), so the student can check a
scorer's chunk boundaries (character offsets) against its own and refuse a score that differs.
Chunks that do not advance in the text (a byte-level piece of a character) are merged into the
next, so boundaries are strictly increasing character offsets. A sample that is not its text's
canonical encoding under the student's tokenizer is aligned through its own pieces' spans (found
by decoding growing prefixes); one that does not even decode back to its text is one chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from mutualrl.thl.align import align_encodings
from mutualrl.thl.peer import represents
from mutualrl.thl.retokenize import Encoded, encode_completion, offsets_by_decoding


@dataclass(frozen=True)
class ScoreChunks:
    """A completion cut into chunks for scoring: per chunk its end (a character offset) and its token
    ranges on the student's side (into the sampled ids) and the scorer's (into ``scorer_ids``)."""

    char_ends: tuple[int, ...]
    student_bounds: tuple[int, ...]
    """``len(char_ends) + 1`` token bounds into the student's sampled ids (its text part)."""
    scorer_ids: tuple[int, ...]
    """The scorer's ids of the completion text (no stop token)."""
    scorer_bounds: tuple[int, ...]
    """``len(char_ends) + 1`` token bounds into :attr:`scorer_ids`."""
    stopped: bool
    """The student's last sampled id is one of its stop ids (a chunk of its own, matched with the
    scorer's EOS)."""
    canonical: bool
    """The student's sampled ids are its tokenizer's encoding of the text (else aligned through their
    own decoded spans, or one chunk when they do not decode to the text)."""

    @property
    def n(self) -> int:
        """Number of text chunks."""
        return len(self.char_ends)

    def sums(self, values: Sequence[float], side: str) -> list[float]:
        """Per text chunk, the sum of ``values`` (one per token of ``side``: ``student`` or ``scorer``)."""
        bounds = self.student_bounds if side == "student" else self.scorer_bounds
        return [float(sum(values[bounds[k]:bounds[k + 1]])) for k in range(self.n)]


def _strict(char_bounds: Sequence[int], a: Sequence[int], b: Sequence[int]
            ) -> tuple[list[int], list[int], list[int]]:
    """Bounds with every chunk that does not advance in the text merged into the next one."""
    keep = [0]
    for i in range(1, len(char_bounds)):
        if char_bounds[i] > char_bounds[keep[-1]]:
            keep.append(i)
        elif i == len(char_bounds) - 1:
            keep[-1] = i  # the last boundary closes the text whatever comes before it
    if keep[-1] != len(char_bounds) - 1:
        keep[-1] = len(char_bounds) - 1
    return ([int(char_bounds[i]) for i in keep], [int(a[i]) for i in keep], [int(b[i]) for i in keep])


def score_chunks(text: str, student_ids: Sequence[int], student_tokenizer: Any, student_prompt: str,
                 student_stop_ids: Collection[int], scorer_tokenizer: Any, scorer_prompt: str
                 ) -> ScoreChunks | None:
    """The chunks in which ``scorer_tokenizer``'s side scores the student's completion ``text``
    (sampled as ``student_ids``), or None when the scorer's tokenizer cannot write the text (it would
    not decode back to it: an unknown character)."""
    ids = [int(i) for i in student_ids]
    stopped = bool(ids) and ids[-1] in student_stop_ids
    n_text = len(ids) - int(stopped)
    t_ids, t_off = encode_completion(scorer_tokenizer, scorer_prompt, text)
    if not represents(scorer_tokenizer, t_ids, text):
        return None
    if not text:
        return ScoreChunks((), (0,), tuple(t_ids), (0,), stopped, True)
    s_ids, s_off = encode_completion(student_tokenizer, student_prompt, text)
    canonical = s_ids == ids[:n_text]
    if not canonical and represents(student_tokenizer, ids[:n_text], text):  # the sampled pieces' own spans
        s_ids, s_off = ids[:n_text], offsets_by_decoding(student_tokenizer, ids[:n_text], text)
    if s_ids == ids[:n_text]:
        al = align_encodings(text, Encoded(text, s_ids, s_off), Encoded(text, t_ids, t_off),
                             source_tokenizer=student_tokenizer, target_tokenizer=scorer_tokenizer)
        chars, sb, tb = _strict(al.char_bounds.tolist(), al.source_bounds.tolist(), al.target_bounds.tolist())
    else:  # the sample does not decode to its text: one chunk
        chars, sb, tb = [0, len(text)], [0, n_text], [0, len(t_ids)]
    return ScoreChunks(tuple(chars[1:]), tuple(sb), tuple(t_ids), tuple(tb), stopped, canonical)
