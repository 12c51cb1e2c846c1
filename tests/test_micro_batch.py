"""Micro-batched updates: every phase, reference and PPO-reference forward accumulated over
micro-batches of whole prompt groups under a token budget equals the one-forward update."""

from __future__ import annotations

import pytest
import torch

from mutualrl.algorithms.micro_batch import StatMerger, forward_tokens, split_micro_batches
from mutualrl.algorithms.registry import OWN, available_strategies
from mutualrl.algorithms.sharing import TrainBatch, TrainRow, parse_strategy
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import GRPOOptions
from mutualrl.rollout.policy import Policy

G = 4


def _rows(kinds: dict, vocab: int, prompts: int = 5, seed: int = 7, dense: bool = False) -> list[TrainRow]:
    """Own groups of G rows of random lengths on ``prompts`` prompts, and for every further kind of the
    strategy two rows on every second prompt (peer chunks covering their tokens for off-policy kinds);
    ``dense``: the own rows carry per-token advantages too (``distill``'s signal)."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[TrainRow] = []
    for p in range(prompts):
        prompt = torch.randint(3, vocab, (4 + p % 4,), generator=gen).tolist()
        for _ in range(G):
            n = 2 + int(torch.randint(0, 6, (1,), generator=gen))
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            lp = (-torch.rand(n, generator=gen) * 3).tolist()
            dense_adv = (torch.randn(n, generator=gen) * 0.3).tolist() if dense else None
            rows.append(TrainRow(prompt, ids, float(torch.randn((), generator=gen)), lp, OWN,
                                 token_advantages=dense_adv))
        for name in (k for k in kinds if k != OWN):
            if p % 2:
                continue
            for _ in range(2):
                n = 3 + int(torch.randint(0, 4, (1,), generator=gen))
                ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
                chunks = [(i, min(n, i + 2), float(-torch.rand((), generator=gen) * 4)) for i in range(0, n, 2)]
                rows.append(TrainRow(prompt, ids, float(torch.randn((), generator=gen)), None, name,
                                     chunks, 0.7))
    return rows


def _train(model, strategy: str, settings: dict, budget: int | None, is_cap: float | None = None,
           **opts) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    # lr 1e-4: AdamW divides each gradient by its own running size, so a weight whose gradient is ~0
    # moves by up to lr on float rounding alone; at 1e-4 that noise is well under the 1e-5 checked
    o = GRPOOptions(num_generations=G, max_completion_length=8, learning_rate=1e-4, dtype="float32",
                    micro_batch_tokens=budget, **opts)
    pol = Policy("p", str(model), o, seed=0)
    for phase, lr in parse_strategy(strategy).optimizer_phases(settings).items():
        pol.add_optimizer(phase, lr)
    kinds = parse_strategy(strategy).kinds(settings)
    vocab = min(len(pol.tokenizer), pol.model.config.vocab_size)
    stats: dict = {}
    for update in range(2):  # the optimizers' moments carry over
        rows = _rows(kinds, vocab, seed=7 + update, dense=strategy.endswith("distill"))
        stats = train_on_batch(pol, TrainBatch(rows, n_prompts=5, kinds=kinds), is_cap=is_cap)
    flat = torch.cat([p.detach().reshape(-1) for p in pol.model.parameters() if p.requires_grad])
    pol.close()
    return flat, stats


CASES = [(s, {}, {}) for s in available_strategies()] + [
    ("imitate", {"imitate": {"learning_rate": 3e-4}}, {"num_iterations": 2, "beta": 0.05, "loss_type": "grpo"}),
    ("prp", {}, {"loss_type": "dapo", "num_iterations": 2}),
    ("sgt", {}, {"loss_type": "dr_grpo", "beta": 0.1}),
    ("guide", {"guide": {"shaping_gamma": 0.1}}, {"loss_type": "bnpo"}),  # LUFFY's shaping weights
    ("independent", {}, {"num_iterations": 2, "is_cap": 1.5}),  # the sampler/trainer mismatch correction
    ("imitate+distill", {}, {"num_iterations": 2, "loss_type": "dapo"}),  # dense per-token advantages
]


@pytest.mark.parametrize(("strategy", "settings", "opts"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_micro_batched_update_equals_the_one_forward_update(tiny_models, strategy, settings, opts):
    """Two updates (PPO iterations, a sharing phase of its own, a KL reference where asked) with
    micro-batches of at most 16 forward tokens, every group cut into pieces, end at the weights of
    the one-forward update within 1e-5; the losses agree, and the micro-batches were really many."""
    one, s1 = _train(tiny_models["tiny-gpt2"], strategy, settings, None, **opts)
    many, s2 = _train(tiny_models["tiny-gpt2"], strategy, settings, 16, **opts)
    if "is_cap" in opts:
        assert s1["is_weight_mean"] == pytest.approx(s2["is_weight_mean"], rel=1e-5)
    assert s1["micro_batches"] == 1 and s2["micro_batches"] >= 5
    assert float((one - many).abs().max()) <= 1e-5
    for k in (k for k in s1 if k.endswith(("loss", "grad_norm"))):
        assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k


def test_micro_batches_keep_groups_whole_and_hold_the_budget():
    """Every row in exactly one micro-batch; a group that fits is never split; no micro-batch over the
    budget unless one row alone is; kinds keep their order."""
    rows = _rows({OWN: None, "peer": None}, 50, prompts=6)
    own = [r for r in rows if r.kind == OWN]
    peer = [r for r in rows if r.kind == "peer"]
    for budget in (8, 30, 60, 200, None):
        micro = split_micro_batches([("own", own), ("peer", peer)], budget)
        seen = [id(r) for m in micro for _, rs in m.parts for r in rs]
        assert sorted(seen) == sorted(id(r) for r in rows)
        for m in micro:
            assert [k for k, _ in m.parts] == [k for k in ("own", "peer") if k in dict(m.parts)]
            flat = [r for _, rs in m.parts for r in rs]
            assert m.forward_tokens == forward_tokens(flat)
            if budget is not None and len(flat) > 1:
                assert m.forward_tokens <= budget
        if budget is not None and budget >= 60:  # every group (prompt + ~6 rows) fits: none is split
            where: dict[tuple, set[int]] = {}
            for i, m in enumerate(micro):
                for _, rs in m.parts:
                    for r in rs:
                        where.setdefault(tuple(r.prompt_ids), set()).add(i)
            assert all(len(v) == 1 for v in where.values())


def test_stat_merger_weights_means_and_keeps_extremes():
    m = StatMerger()
    m.add({"clip_frac": 0.5, "logprob_mismatch_max": 1.0}, 10)
    m.add({"clip_frac": 0.0, "logprob_mismatch_max": 3.0}, 30)
    assert m.result() == {"clip_frac": pytest.approx(0.125), "logprob_mismatch_max": 3.0}
