"""The policy zoo: small, genuinely heterogeneous causal LMs built locally (the embedded default).

Each zoo policy has its own architecture family (GPT-2, Llama, GPT-NeoX, Qwen2 from
``transformers`` configs), its own tokenizer *algorithm* trained on the task text (byte-level BPE,
Unigram, character level; see :mod:`mutualrl.zoo_tokenizers`) and its own vocabulary size. A short
supervised warm start on a skewed mixture of task types gives each one partial, complementary
skill (e.g. good-ish at addition and weak at subtraction, or the reverse), which is what mutual
training then has to share.

Built policies are ordinary Hugging Face directories (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) plus ``zoo_card.json``
(spec, size, tokenizer, measured accuracies). They are cached under
``$MUTUALRL_CACHE/zoo/<hash>/<name>`` (default ``~/.cache/mutualrl``), the hash covering the
spec, the seed and :data:`ZOO_VERSION`, so a second run loads in seconds. A config refers to one
as ``model: zoo:<name>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError

ZOO_VERSION = "2"
"""Bump when anything that changes a built policy changes (code, task, tokenizers)."""

PROMPT_TEMPLATE = "{question} Answer: "
"""How a question becomes a prompt; the completion is the answer followed by EOS."""

MAX_NEW_TOKENS = 8
"""Completion budget used when the zoo measures accuracy (answers have at most 4 characters)."""

ARCHS: tuple[str, ...] = ("gpt2", "llama", "gpt_neox", "qwen2")
"""Architecture families a :class:`ZooSpec` can name (``transformers`` model types)."""


# ----------------------------------------------------------------------------- the task
def default_task(seed: int = 0, test_size: int = 1000, train_size: int = 20000):
    """The demo task: 2-digit addition (``add``) and subtraction (``sub``) from reasoning-gym.

    Two terms, no parentheses, no negated operands; equal weights, so ``test_size=1000`` gives
    500 held-out problems per type. Train and test are disjoint by question.
    """
    from mutualrl.tasks import GymSource, Task

    cfg = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
               "allow_parentheses": False, "allow_negation": False}
    return Task(
        [GymSource("basic_arithmetic", "add", dict(cfg, operators=["+"])),
         GymSource("basic_arithmetic", "sub", dict(cfg, operators=["-"]))],
        [1, 1], test_size=test_size, train_size=train_size, seed=seed,
    )


def format_prompt(question: str) -> str:
    """The zoo's prompt for ``question`` (:data:`PROMPT_TEMPLATE`)."""
    return PROMPT_TEMPLATE.format(question=question)


# ----------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ZooSpec:
    """How to build one zoo policy.

    ``sft_mixture`` maps task types (source names of :func:`default_task`) to their share of the
    warm-start examples. SFT stops early once greedy accuracy on a validation slice of the
    training problems (never the test split) reaches ``sft_target`` for every type named there,
    checked every ``sft_eval_every`` steps: the sharp, run-dependent onset of skill in tiny models
    makes a fixed step count land anywhere from 15 % to 80 %. ``n_inner`` of 0 means 4 × ``n_embd``; ``n_kv_head`` of 0 means
    ``n_head`` (only Llama/Qwen2 use it). ``vocab_size`` is an upper bound given to the tokenizer
    trainer (the card records the real size).
    """

    name: str
    arch: str
    tokenizer: str
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    sft_mixture: dict[str, float]
    sft_steps: int
    lr: float = 2e-3
    batch: int = 64
    n_inner: int = 0
    n_kv_head: int = 0
    warmup_frac: float = 0.05
    weight_decay: float = 0.01
    max_positions: int = 128
    sft_target: dict[str, float] = field(default_factory=dict)
    sft_eval_every: int = 50
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the spec."""
        return dataclasses.asdict(self)

    def cache_key(self, seed: int) -> str:
        """Hash of (spec, seed, :data:`ZOO_VERSION`) naming the cache folder."""
        payload = json.dumps({"spec": self.to_dict(), "seed": seed, "version": ZOO_VERSION},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


ZOO: dict[str, ZooSpec] = {
    "gpt2-add": ZooSpec(
        name="gpt2-add", arch="gpt2", tokenizer="byte_bpe", vocab_size=384,
        n_layer=3, n_embd=160, n_head=4, sft_mixture={"add": 0.8, "sub": 0.2},
        sft_steps=1000, lr=3e-3, batch=96, sft_target={"add": 0.4},
        description="GPT-2 family, byte-level BPE; warm-started mostly on addition",
    ),
    "llama-sub": ZooSpec(
        name="llama-sub", arch="llama", tokenizer="unigram", vocab_size=400,
        n_layer=3, n_embd=144, n_head=4, n_kv_head=2, n_inner=384,
        sft_mixture={"add": 0.15, "sub": 0.85}, sft_steps=1000, lr=3e-3, batch=96,
        sft_target={"sub": 0.4},
        description="Llama family (GQA, RoPE, SwiGLU), SentencePiece-style Unigram; "
                    "warm-started mostly on subtraction",
    ),
    "neox-mix": ZooSpec(
        name="neox-mix", arch="gpt_neox", tokenizer="char", vocab_size=128,
        n_layer=3, n_embd=128, n_head=4, sft_mixture={"add": 0.5, "sub": 0.5},
        sft_steps=1000, lr=3e-3, batch=96, sft_target={"add": 0.2, "sub": 0.2},
        description="GPT-NeoX family (parallel residual, partial rotary), character level; "
                    "a weak generalist warm-started on both types",
    ),
}
"""The default zoo policies, by name."""

DEFAULT_NAMES: tuple[str, ...] = ("gpt2-add", "llama-sub")
"""The policies :func:`build_zoo` builds when no names are given (the demo's two learners)."""


def _check_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise UserError(f"unknown zoo polic{'y' if len(unknown) == 1 else 'ies'} "
                        f"{', '.join(map(repr, unknown))}; valid: {', '.join(ZOO)}")


# ----------------------------------------------------------------------------- models
def build_model(spec: ZooSpec, tokenizer: Any):
    """A freshly initialised causal LM for ``spec`` with ``tokenizer``'s size and special ids."""
    import transformers as tf

    common = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    inner = spec.n_inner or 4 * spec.n_embd
    if spec.arch == "gpt2":
        cfg = tf.GPT2Config(n_positions=spec.max_positions, n_embd=spec.n_embd,
                            n_layer=spec.n_layer, n_head=spec.n_head, n_inner=inner,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif spec.arch in ("llama", "qwen2"):
        cls_cfg, cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if spec.arch == "llama"
                        else (tf.Qwen2Config, tf.Qwen2ForCausalLM))
        cfg = cls_cfg(hidden_size=spec.n_embd, intermediate_size=inner,
                      num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                      num_key_value_heads=spec.n_kv_head or spec.n_head,
                      max_position_embeddings=spec.max_positions, tie_word_embeddings=True,
                      **common)
        model = cls(cfg)
    elif spec.arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=spec.n_embd, intermediate_size=inner,
                               num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                               max_position_embeddings=spec.max_positions, rotary_pct=0.5,
                               use_parallel_residual=True, hidden_dropout=0.0,
                               attention_dropout=0.0, tie_word_embeddings=False, **common)
        model = tf.GPTNeoXForCausalLM(cfg)
    else:
        raise UserError(f"unknown zoo architecture {spec.arch!r}; valid: {', '.join(ARCHS)}")
    model.generation_config.update(bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)
    return model


# ----------------------------------------------------------------------------- SFT
def _encode_examples(tokenizer: Any, problems: Sequence[Any]) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per problem: prompt ids + answer ids + EOS."""
    prompts = tokenizer([format_prompt(p.question) for p in problems],
                        add_special_tokens=False)["input_ids"]
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(list(p) + list(a) + [eos], len(p)) for p, a in zip(prompts, answers)]


def _collate(examples: Sequence[tuple[list[int], int]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in examples)
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, plen) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = t
        mask[i, : len(ids)] = 1
        labels[i, plen: len(ids)] = t[plen:]
    return input_ids, mask, labels


VAL_SIZE = 200
"""Training problems per type held out of SFT to decide early stopping (the last ones)."""


def _val_accuracy(model: Any, tokenizer: Any, task: Any, val: dict[str, list[Any]]) -> dict[str, float]:
    from mutualrl.tasks import SUCCESS_THRESHOLD

    out = {}
    for k, problems in val.items():
        texts = generate_answers(model, tokenizer, [format_prompt(p.question) for p in problems])
        out[k] = sum(task.verify(p, t) >= SUCCESS_THRESHOLD
                     for p, t in zip(problems, texts)) / len(problems)
    return out


def sft(model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int,
        on_step: Callable[[int, float], None] | None = None,
        history: list[dict[str, Any]] | None = None) -> list[float]:
    """Warm-start ``model`` on ``spec.sft_mixture`` of ``task``'s training problems.

    Loss on the completion (answer + EOS) only; AdamW with linear warm-up and cosine decay to
    10 % over ``spec.sft_steps``; stops early when ``spec.sft_target`` is reached on the
    validation slice (each check appended to ``history``). Deterministic in ``seed``. Returns
    the loss per step (its length is the number of steps done).
    """
    history = [] if history is None else history
    import torch
    import torch.nn.functional as F

    unknown = [k for k in spec.sft_mixture if k not in task.train]
    if unknown:
        raise UserError(f"zoo policy {spec.name!r}: unknown task type(s) {unknown} in sft_mixture;"
                        f" valid: {sorted(task.train)}")
    types = [k for k, w in spec.sft_mixture.items() if w > 0]
    weights = torch.tensor([spec.sft_mixture[k] for k in types], dtype=torch.float)
    n_val = VAL_SIZE if spec.sft_target else 0
    val = {k: task.train[k][-n_val:] for k in spec.sft_target}
    pools = {k: _encode_examples(tokenizer, task.train[k][: len(task.train[k]) - n_val])
             for k in types}
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98),
                            weight_decay=spec.weight_decay)
    warm = max(1, int(spec.warmup_frac * spec.sft_steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, spec.sft_steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses: list[float] = []
    for step in range(spec.sft_steps):
        kinds = torch.multinomial(weights, spec.batch, replacement=True, generator=gen).tolist()
        batch = []
        for k in kinds:
            pool = pools[types[k]]
            batch.append(pool[int(torch.randint(len(pool), (1,), generator=gen))])
        input_ids, mask, labels = _collate(batch, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
        if val and (step + 1) % spec.sft_eval_every == 0:
            acc = _val_accuracy(model, tokenizer, task, val)
            history.append({"step": step + 1, **acc})
            model.train()
            if all(acc[k] >= t for k, t in spec.sft_target.items()):
                break
    model.eval()
    return losses


# ----------------------------------------------------------------------------- evaluation
def _cache_of(output: Any) -> Any:
    return output["cache"] if "cache" in output else output["past_key_values"]


def generate_answers(model: Any, tokenizer: Any, prompts: Sequence[str], *,
                     max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.0,
                     seed: int = 0, batch_size: int = 512) -> list[str]:
    """Complete each prompt (greedy when ``temperature`` is 0, else plain sampling, no top-k/p).

    Prompts are grouped by token length so no padding is ever needed (exactly how the zoo
    trained). Stops at EOS; returns the decoded completions without special tokens.
    """
    import torch

    enc = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(enc):
        by_len.setdefault(len(ids), []).append(i)
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    out: list[str] = [""] * len(enc)
    # transformers 5 renamed ``past_key_values`` to ``cache``; accept both
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model.eval()
    with torch.no_grad():
        for length in sorted(by_len):
            idx_all = by_len[length]
            for start in range(0, len(idx_all), batch_size):
                idx = idx_all[start: start + batch_size]
                ids = torch.tensor([enc[i] for i in idx], dtype=torch.long)
                res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                past, logits = _cache_of(res), res.logits[:, -1]
                done = torch.zeros(len(idx), dtype=torch.bool)
                new: list[torch.Tensor] = []
                for _ in range(max_new_tokens):
                    if temperature > 0:
                        probs = torch.softmax(logits.float() / temperature, dim=-1)
                        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                    else:
                        nxt = logits.argmax(-1)
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    new.append(nxt)
                    done |= nxt == eos
                    if bool(done.all()):
                        break
                    res = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: past})
                    past, logits = _cache_of(res), res.logits[:, -1]
                toks = torch.stack(new, 1).tolist()
                for j, i in enumerate(idx):
                    row = toks[j]
                    if eos in row:
                        row = row[: row.index(eos)]
                    out[i] = tokenizer.decode(row, skip_special_tokens=True)
    return out


def evaluate(model: Any, tokenizer: Any, task: Any, *, temperature: float = 0.0,
             n_per_type: int | None = None, seed: int = 0) -> dict[str, float]:
    """Exact accuracy (verifier score ≥ 0.999) per task type on ``task``'s test split."""
    from mutualrl.tasks import SUCCESS_THRESHOLD

    acc: dict[str, float] = {}
    for name, problems in task.test.items():
        problems = problems[:n_per_type] if n_per_type else problems
        texts = generate_answers(model, tokenizer, [format_prompt(p.question) for p in problems],
                                 temperature=temperature, seed=seed)
        ok = sum(task.verify(p, t) >= SUCCESS_THRESHOLD for p, t in zip(problems, texts))
        acc[name] = ok / max(1, len(problems))
    return acc


# ----------------------------------------------------------------------------- building
def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where built zoo policies live: ``cache_dir``, else ``$MUTUALRL_CACHE/zoo``, else
    ``~/.cache/mutualrl/zoo``."""
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("MUTUALRL_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "mutualrl") / "zoo"


def policy_dir(name: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory of zoo policy ``name`` for ``seed`` (it may not be built yet)."""
    _check_names([name])
    return cache_root(cache_dir) / ZOO[name].cache_key(seed) / name


def _is_built(path: Path) -> bool:
    return (path / "zoo_card.json").is_file() and (path / "model.safetensors").is_file()


def _corpus(task: Any, limit: int = 4000) -> list[str]:
    """Tokenizer training text: training prompts with their answers, all task types, an evenly
    strided subset of at most ``limit`` (the text is very regular; more only costs time)."""
    texts = [format_prompt(p.question) + p.answer for k in task.train for p in task.train[k]]
    return texts[:: max(1, math.ceil(len(texts) / limit))]


def _weights_hash(model: Any) -> str:
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _build_one(spec: ZooSpec, seed: int, task: Any, target: Path,
               on_step: Callable[[int, float], None] | None) -> dict[str, Any]:
    import torch

    from mutualrl.zoo_tokenizers import tokenizer_model_type, train_tokenizer

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(spec.tokenizer, _corpus(task), spec.vocab_size)
    torch.manual_seed(seed)
    model = build_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    history: list[dict[str, Any]] = []
    losses = sft(model, tokenizer, task, spec, seed, on_step, history)
    t_sft = time.perf_counter() - t0
    greedy = evaluate(model, tokenizer, task, temperature=0.0, seed=seed)
    sampled = evaluate(model, tokenizer, task, temperature=1.0, seed=seed)
    k = max(1, len(losses) // 20)
    card = {
        "name": spec.name, "seed": seed, "zoo_version": ZOO_VERSION, "spec": spec.to_dict(),
        "model_type": model.config.model_type, "architecture": type(model).__name__,
        "n_params": n_params, "tokenizer_kind": spec.tokenizer,
        "tokenizer_model": tokenizer_model_type(tokenizer), "vocab_size": len(tokenizer),
        "special_tokens": {"pad": [tokenizer.pad_token, tokenizer.pad_token_id],
                           "bos": [tokenizer.bos_token, tokenizer.bos_token_id],
                           "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
                           "unk": [tokenizer.unk_token, tokenizer.unk_token_id]},
        "prompt_template": PROMPT_TEMPLATE,
        "sft_steps_done": len(losses), "sft_val_history": history,
        "sft_loss_first": sum(losses[:k]) / k, "sft_loss_last": sum(losses[-k:]) / k,
        "accuracy_greedy": greedy, "accuracy_sampled_t1": sampled,
        "n_test_per_type": {name: len(p) for name, p in task.test.items()},
        "weights_sha256": _weights_hash(model),
        "build_s": round(time.perf_counter() - t0, 1), "sft_s": round(t_sft, 1),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "zoo_card.json").write_text(json.dumps(card, indent=2) + "\n")
        if target.exists() and not _is_built(target):  # a broken copy (not ours): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not _is_built(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return card


def build_zoo(names: Sequence[str] | None = None, seed: int = 0,
              cache_dir: str | os.PathLike[str] | None = None, progress: bool = True,
              specs: dict[str, ZooSpec] | None = None) -> dict[str, Path]:
    """Build (or load from the cache) zoo policies and return their model directories.

    ``names`` defaults to :data:`DEFAULT_NAMES`. ``specs`` overrides :data:`ZOO` (tests use tiny
    variants). Each policy is trained in this process with 2 torch threads, deterministic in
    ``seed``, and written atomically (temporary directory + rename).
    """
    import torch

    table = ZOO if specs is None else specs
    names = list(DEFAULT_NAMES if names is None else names)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise UserError(f"unknown zoo policy {', '.join(map(repr, unknown))}; "
                        f"valid: {', '.join(table)}")
    root = cache_root(cache_dir)
    dirs = {n: root / table[n].cache_key(seed) / n for n in names}
    todo = [n for n in names if not _is_built(dirs[n])]
    if not todo:
        return dirs
    task = default_task(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    try:
        if progress:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns = (TextColumn("[bold]zoo[/] {task.description}"), BarColumn(),
                       MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                       TimeElapsedColumn(), TimeRemainingColumn())
            with Progress(*columns) as bar:
                ids = {n: bar.add_task(n, total=table[n].sft_steps, loss="-") for n in todo}
                for n in todo:
                    def tick(step: int, loss: float, _id: Any = ids[n]) -> None:
                        bar.update(_id, completed=step + 1, loss=f"{loss:.3f}")
                    card = _build_one(table[n], seed, task, dirs[n], tick)
                    acc = ", ".join(f"{k} {v:.0%}" for k, v in card["accuracy_greedy"].items())
                    bar.update(ids[n], description=f"{n} ({acc})")
        else:
            for n in todo:
                _build_one(table[n], seed, task, dirs[n], None)
    finally:
        torch.set_num_threads(threads)
    return dirs


def build_tiny_models(root: str | os.PathLike[str]) -> dict[str, Path]:
    """Two untrained, very small zoo-family models for tests and fault benchmarks (seconds to build).

    ``{"tiny-gpt2": dir (GPT-2, byte-level BPE), "tiny-llama": dir (Llama, Unigram)}`` under
    ``root``; a directory that already holds a model is reused.
    """
    import torch

    from mutualrl.zoo_tokenizers import train_tokenizer

    root = Path(root)
    torch.manual_seed(0)
    task = default_task(seed=0, test_size=50, train_size=500)
    texts = [p.question + " Answer: " + p.answer for p in task.problems("train")]
    out = {}
    for name, zoo_name, kind, extra in [("tiny-gpt2", "gpt2-add", "byte_bpe", {}),
                                        ("tiny-llama", "llama-sub", "unigram", {"n_kv_head": 1})]:
        d = root / name
        if not (d / "config.json").is_file():
            spec = dataclasses.replace(ZOO[zoo_name], n_layer=1, n_embd=32, n_head=2, n_inner=64, **extra)
            tok = train_tokenizer(kind, texts, spec.vocab_size)
            build_model(spec, tok).save_pretrained(d)
            tok.save_pretrained(d)
        out[name] = d
    return out


def zoo_model_dir(name: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                  progress: bool = True) -> Path:
    """The model directory of zoo policy ``name`` (``model: zoo:<name>``), built on demand."""
    _check_names([name])
    return build_zoo([name], seed=seed, cache_dir=cache_dir, progress=progress)[name]


def resolve_model(ref: str, seed: int = 0) -> str:
    """Turn ``zoo:<name>`` into its (built) directory; any other model reference is unchanged."""
    if ref.startswith("zoo:"):
        return str(zoo_model_dir(ref[len("zoo:"):], seed=seed))
    return ref


def load_card(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``zoo_card.json`` of a built zoo policy directory."""
    return json.loads((Path(path) / "zoo_card.json").read_text())


# ----------------------------------------------------------------------------- CLI
def _cmd_build(args: Any) -> int:
    names = args.names or None
    if names:
        _check_names(names)
    t0 = time.perf_counter()
    dirs = build_zoo(names, seed=args.seed, cache_dir=args.cache_dir, progress=True)
    for name, path in dirs.items():
        card = load_card(path)
        acc = "  ".join(f"{k} {v:.1%}" for k, v in card["accuracy_greedy"].items())
        print(f"{name:10s} {card['architecture']:20s} {card['tokenizer_model']:9s} "
              f"vocab {card['vocab_size']:4d}  {card['n_params'] / 1e6:.2f}M  greedy: {acc}  {path}")
    print(f"zoo ready in {time.perf_counter() - t0:.1f}s")
    return 0


def _cmd_list(args: Any) -> int:
    for name, spec in ZOO.items():
        path = policy_dir(name, args.seed, args.cache_dir)
        if _is_built(path):
            card = load_card(path)
            state = "built: greedy " + ", ".join(f"{k} {v:.1%}"
                                                 for k, v in card["accuracy_greedy"].items())
        else:
            state = "not built"
        default = "*" if name in DEFAULT_NAMES else " "
        mix = ", ".join(f"{k} {v:g}" for k, v in spec.sft_mixture.items())
        print(f"{default} zoo:{name:10s} {spec.arch:8s} {spec.tokenizer:8s} "
              f"L{spec.n_layer} d{spec.n_embd}  sft [{mix}]  {state}")
    print("(* = built by default; `mutualrl zoo build --names ...` builds others)")
    return 0


def register(subparsers: Any) -> None:
    """Add ``mutualrl zoo build|list`` to the CLI."""
    p = subparsers.add_parser("zoo", help="build or list the embedded default policies (the zoo)",
                              description="The policy zoo: small heterogeneous LMs built locally "
                              "(no download), warm-started with complementary skills and cached.")
    sub = p.add_subparsers(dest="zoo_command", metavar="ACTION")
    for action, func, text in (("build", _cmd_build, "build (or load from the cache) zoo policies"),
                               ("list", _cmd_list, "list zoo policies and whether they are built")):
        q = sub.add_parser(action, help=text, description=text)
        q.add_argument("--seed", type=int, default=0, help="build seed (default 0)")
        q.add_argument("--cache-dir", default=None,
                       help="cache folder (default $MUTUALRL_CACHE/zoo or ~/.cache/mutualrl/zoo)")
        if action == "build":
            q.add_argument("--names", nargs="+", metavar="NAME",
                           help=f"policies to build (default: {' '.join(DEFAULT_NAMES)}; "
                           f"all: {' '.join(ZOO)})")
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
