"""A policy: a Hugging Face causal LM, its tokenizer, its optimizer (and a frozen reference).

Token-level tensors for training use a *right-aligned* layout ``[B, C]``: the completion of row
``i`` occupies its last ``len_i`` columns, so one forward pass over left-padded
``prompt + completion`` sequences yields every completion log-prob from the last ``C + 1``
logits only (no full-vocabulary logits for the prompt positions).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mutualrl.config import GRPOOptions


@dataclass
class Sample:
    """One sampled completion and its behavior trace."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    """Sampled tokens, EOS included when generation stopped on it."""
    text: str
    """Decoded completion text (special tokens removed)."""
    logprobs: list[float]
    """Behavior log-prob of each sampled token under the sampling distribution."""
    finished: bool


def resolve_model_path(ref: str) -> str:
    """Map ``zoo:<name>`` / ``real:<name>`` to a local directory; other refs pass through."""
    if ref.startswith("zoo:"):
        from mutualrl import zoo

        # the zoo's build seed is part of the reference (zoo:NAME@SEED, default 0), never the run's
        # seed: every run seed starts from the same warm-started policy
        name, _, zseed = ref[4:].partition("@")
        return str(zoo.zoo_model_dir(name, seed=int(zseed or 0)))
    if ref.startswith("real:"):
        from mutualrl import realmodels

        return str(realmodels.resolve_model_ref(ref))
    return str(Path(ref).expanduser()) if Path(ref).expanduser().exists() else ref


def tokenizer_fingerprint(tokenizer) -> str:
    """A short id of a tokenizer: class, vocabulary size and a hash of the vocabulary."""
    import hashlib

    vocab = tokenizer.get_vocab()
    h = hashlib.sha1("\n".join(sorted(vocab)).encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{type(tokenizer).__name__}-{len(vocab)}-{h}"


def pack_right(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pack ragged rows into a right-aligned ``[len(rows), width]`` tensor."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, width - len(r):] = torch.as_tensor(list(r), dtype=dtype)
    return out


def right_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Boolean ``[B, width]`` mask of the right-aligned positions holding tokens."""
    lens = torch.as_tensor(list(lengths)).unsqueeze(1)
    return torch.arange(width).unsqueeze(0) >= (width - lens)


class Policy:
    """A trainable causal LM with its tokenizer, optimizer and optional frozen reference.

    Args:
        name: the policy's name (its source id in the exchange).
        model_path: a local directory or hub id for ``from_pretrained``.
        options: GRPO options (sampling, optimizer, dtype).
        prompt_template: a format string with ``{question}`` or ``"chat"``.
        seed: seeds the sampling generator.
    """

    share_prompt_prefix: bool = True
    """Run a prompt shared by several rows (a GRPO group) through the model once, in sampling and
    in :meth:`logprobs`, and reuse its KV cache for every row (same values, less work)."""

    def __init__(self, name: str, model_path: str, options: GRPOOptions, *,
                 prompt_template: str = "{question} Answer: ", system_prompt: str | None = None,
                 seed: int = 0, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.model_path = model_path
        self.options = options
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.config.use_cache = True
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer of {model_path!r} has no EOS token; generation could never stop")
        self.eos_ids = {tok.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            self.eos_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            self.eos_ids.update(gen_eos)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if options.dtype == "bfloat16" and self.device.type == "cpu" and not cpu_has_native_bf16():
            import warnings

            warnings.warn("dtype: bfloat16 on a CPU without native bf16 matmuls (no avx512_bf16/amx_bf16): "
                          "bf16 autocast is emulated there and much slower than float32 "
                          "(see docs/performance.md)", RuntimeWarning, stacklevel=2)
        self.ref_model = None
        if options.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.learning_rate, weight_decay=options.weight_decay,
            betas=(options.adam_beta1, options.adam_beta2), **_adamw_impl(self.device))
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.version = 0

    # ------------------------------------------------------------------ prompts
    @property
    def tokenizer_id(self) -> str:
        """A short id of the tokenizer (its class, vocabulary size and a content hash)."""
        if not hasattr(self, "_tok_id"):
            self._tok_id = tokenizer_fingerprint(self.tokenizer)
        return self._tok_id

    def format_prompt(self, question: str) -> str:
        """The prompt text for ``question`` (template or chat template)."""
        if self.prompt_template == "chat":
            msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            msgs.append({"role": "user", "content": question})
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.prompt_template.format(question=question)

    def encode_prompt(self, question: str) -> list[int]:
        """Token ids of the prompt for ``question`` (BOS per the tokenizer; no EOS)."""
        text = self.format_prompt(question)
        add_special = self.prompt_template != "chat"
        ids = self.tokenizer(text, add_special_tokens=add_special)["input_ids"]
        while ids and ids[-1] in self.eos_ids:  # some post-processors append EOS; a prompt must not end
            ids = ids[:-1]
        return list(ids)

    def encode_completion(self, text: str, add_eos: bool = True) -> list[int]:
        """Token ids of a completion text as this policy would emit it (EOS appended)."""
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if add_eos:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _autocast(self):
        if self.options.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ generation
    def _left_pad(self, seqs: Sequence[Sequence[int]], min_width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(min_width, max(len(s) for s in seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                ids[i, width - len(s):] = torch.as_tensor(list(s))
                mask[i, width - len(s):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], *, greedy: bool = False,
                     max_new_tokens: int | None = None) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Sample one completion per prompt (KV cache, left padding). Returns ids, logprobs, finished."""
        opts = self.options
        max_new = max_new_tokens or opts.max_completion_length
        model = self.model
        was_training = model.training
        model.eval()
        uniq, inv = dedupe_prompts(prompt_ids)
        if not self.share_prompt_prefix:
            uniq, inv = [list(p) for p in prompt_ids], list(range(len(prompt_ids)))
        ids, mask = self._left_pad(uniq)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        b = len(prompt_ids)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        finished = torch.zeros(b, dtype=torch.bool, device=self.device)
        out_tok = torch.full((b, max_new), self.pad_id, dtype=torch.long, device=self.device)
        out_lp = torch.zeros((b, max_new), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        with self._autocast():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache_kw = _cache_kwarg(model)
        past = getattr(out, cache_kw)
        logits = out.logits[:, -1].float()
        if len(uniq) < b:  # each distinct prompt was prefilled once: index its cache out to its rows
            rows = torch.tensor(inv, device=self.device)
            past.batch_select_indices(rows)
            mask, pos, logits = mask[rows], pos[rows], logits[rows]
        for t in range(max_new):
            if greedy:
                logp = F.log_softmax(logits, dim=-1)
                tok = logp.argmax(-1)
            else:
                logp = F.log_softmax(logits / opts.temperature, dim=-1)
                if opts.top_p < 1.0:
                    logp = _top_p_filter(logp, opts.top_p)
                tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(1)
            tok_lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
            alive = ~finished
            out_tok[:, t] = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
            out_lp[:, t] = torch.where(alive, tok_lp, torch.zeros_like(tok_lp))
            lengths += alive.long()
            finished = finished | torch.isin(tok, eos)
            if bool(finished.all()) or t == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            pos = pos[:, -1:] + 1
            with self._autocast():
                out = model(input_ids=out_tok[:, t:t + 1], attention_mask=mask, position_ids=pos,
                            use_cache=True, **{cache_kw: past})
            past = getattr(out, cache_kw)
            logits = out.logits[:, -1].float()
        if was_training:
            model.train()
        lens = lengths.tolist()
        toks = out_tok.tolist()
        lps = out_lp.tolist()
        fin = finished.tolist()
        return ([toks[i][:lens[i]] for i in range(b)], [lps[i][:lens[i]] for i in range(b)], fin)

    def generate(self, questions: Sequence[str], num_generations: int | None = None, *,
                 greedy: bool = False, batch_size: int | None = None) -> list[Sample]:
        """Sample ``num_generations`` completions per question (grouped: prompt-major order)."""
        g = 1 if greedy else (num_generations or self.options.num_generations)
        prompts = [self.encode_prompt(q) for q in questions]
        flat = [(i, p) for i, p in enumerate(prompts) for _ in range(g)]
        samples: list[Sample] = []
        bs = batch_size or len(flat)
        for start in range(0, len(flat), bs):
            chunk = flat[start:start + bs]
            ids, lps, fin = self.generate_ids([p for _, p in chunk], greedy=greedy)
            for (i, p), c, lp, f in zip(chunk, ids, lps, fin, strict=True):
                text = self.tokenizer.decode(c, skip_special_tokens=True)
                samples.append(Sample(i, p, c, text, lp, f))
        return samples

    # ------------------------------------------------------------------ training-side log-probs
    def _forward_logprobs(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                          completion_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        uniq, inv = dedupe_prompts(prompt_ids)
        if (self.share_prompt_prefix and len(uniq) < len(prompt_ids)
                and max(len(c) for c in completion_ids) <= width):
            return self._forward_logprobs_shared(model, uniq, inv, completion_ids, width)
        seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        # at least width + 1 columns, so the last width + 1 logits exist even when every sequence is
        # shorter than the requested width (e.g. short rescue rows packed to a batch's width)
        ids, mask = self._left_pad(seqs, min_width=width + 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                           logits_to_keep=width + 1).logits
        logits = logits[:, :-1].float() / self.options.temperature
        targets = ids[:, -width:]
        tok_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return tok_logit - torch.logsumexp(logits, dim=-1)

    def _forward_logprobs_shared(self, model: torch.nn.Module, uniq: list[list[int]], inv: list[int],
                                 completion_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """:meth:`_forward_logprobs` for rows that share prompts (a GRPO group): each distinct prompt
        runs through the model once, its KV cache is indexed out to its rows, and only the
        completions run per row. Same values and gradients (the prompt's gradient is the sum over
        its rows), about ``prompt / (prompt + completion) * (1 - 1/G)`` less forward and backward
        work. Completions are left-aligned after the cached prompt, then laid out right-aligned."""
        dev = self.device
        b = len(completion_ids)
        lens = torch.tensor([len(c) for c in completion_ids], device=dev)
        cmax = max(1, int(lens.max()))
        p_ids, p_mask = self._left_pad(uniq)
        p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
        rows = torch.tensor(inv, device=dev)
        c_ids = torch.full((b, cmax), self.pad_id, dtype=torch.long)
        c_mask = torch.zeros((b, cmax), dtype=torch.long)
        for i, c in enumerate(completion_ids):
            if c:
                c_ids[i, :len(c)] = torch.as_tensor(list(c))
                c_mask[i, :len(c)] = 1
        c_ids, c_mask = c_ids.to(dev), c_mask.to(dev)
        cache_kw = _cache_kwarg(model)
        with self._autocast():
            out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                        logits_to_keep=1)
        # the prompt's last logit predicts each row's first completion token
        parts = [_token_logprobs(out.logits[:, -1:][rows], c_ids[:, :1], self.options.temperature)]
        if cmax > 1:
            cache = getattr(out, cache_kw)
            cache.batch_select_indices(rows)
            mask = torch.cat([p_mask[rows], c_mask], dim=1)
            pos = p_mask.sum(-1, keepdim=True)[rows] + torch.arange(cmax, device=dev).unsqueeze(0)
            keep = torch.arange(cmax - 1, device=dev)  # position j predicts completion token j + 1
            with self._autocast():
                out2 = model(input_ids=c_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=keep, **{cache_kw: cache})
            parts.append(_token_logprobs(out2.logits, c_ids[:, 1:], self.options.temperature))
        left = torch.cat(parts, dim=1)  # [B, cmax], completion token j in column j
        j = torch.arange(width, device=dev).unsqueeze(0) - (width - lens).unsqueeze(1)
        valid = j >= 0
        right = left.gather(1, j.clamp(min=0, max=cmax - 1))
        return torch.where(valid, right, torch.zeros_like(right))

    def logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                 width: int | None = None, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs ``[B, C]`` (right-aligned) of the completions under current weights.

        Scaled by the sampling temperature, like the behavior log-probs from :meth:`generate`.
        Gradients flow unless called under ``torch.no_grad``. ``reference=True`` uses the frozen
        reference model (no gradient).
        """
        c = width or max(1, max(len(x) for x in completion_ids))
        if reference:
            if self.ref_model is None:
                raise RuntimeError("no reference model: beta == 0")
            with torch.no_grad():
                return self._forward_logprobs(self.ref_model, prompt_ids, completion_ids, c)
        return self._forward_logprobs(self.model, prompt_ids, completion_ids, c)

    # ------------------------------------------------------------------ persistence
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def dedupe_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order and, per row, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}
    inv = []
    for p in prompt_ids:
        inv.append(index.setdefault(tuple(p), len(index)))
    return [list(k) for k in index], inv


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / T)`` at ``targets`` (``[B, n, V]``, ``[B, n]`` -> ``[B, n]``), in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    tok = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return tok - torch.logsumexp(logits, dim=-1)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (Linux ``/proc/cpuinfo``; True if unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return True


def _adamw_impl(device: torch.device) -> dict[str, bool]:
    """AdamW's fused kernel where this torch has one for ``device`` (one pass over each parameter
    instead of a dozen foreach sweeps: ~4x faster steps on CPU), else the foreach default."""
    if device.type in ("cpu", "cuda"):
        try:
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
            return {"fused": True}
        except (RuntimeError, TypeError, ValueError):
            pass
    return {}


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The KV-cache argument name of this transformers version (``cache`` or ``past_key_values``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _top_p_filter(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised log-probs restricted to the nucleus of mass ``top_p``."""
    sorted_lp, idx = logp.sort(dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(-1)
    drop_sorted = (cum - sorted_lp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    filtered = logp.masked_fill(drop, -math.inf)
    return filtered - torch.logsumexp(filtered, dim=-1, keepdim=True)
