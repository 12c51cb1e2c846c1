"""A sharing step owns its rows, its loss terms and its settings: the registry declares them, the
update sums declared terms, chains are ordered by what each step needs, settings are validated."""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mutualrl.algorithms.losses import TermInputs, register_loss
from mutualrl.algorithms.registry import (
    OWN_GROUPS,
    RowKind,
    StrategyError,
    available_strategies,
    parse_strategy,
    register_strategy,
    unregister_strategy,
)
from mutualrl.algorithms.replay import PastSuccess, Replay
from mutualrl.algorithms.sharing import (
    OwnGroup,
    PeerRows,
    ShareContext,
    TrainRow,
    build_batch,
    own_rows_by_prompt,
)
from mutualrl.config import GRPOOptions
from mutualrl.config.resolve import load_config
from mutualrl.config.schema import bounded
from mutualrl.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent / "mutualrl"


def test_update_and_worker_name_no_strategy_and_no_row_kind():
    """update.py and worker.py know no strategy by name and no row kind but by the registry's
    declarations: no registered step name appears in them as a word, no declared row kind (nor a
    strategy name, the base step's and its own rows' included) as a string literal, and no flat
    sharing setting of earlier releases."""
    names = set(available_strategies()) - {"independent"}
    kinds = {k for n in names for k in parse_strategy(n).kinds()} - {"own"}
    for f in ("algorithms/update.py", "run/worker.py"):
        text = (PACKAGE / f).read_text()
        words = [w for w in sorted(names) if re.search(rf"(?<![A-Za-z_]){w}(?![A-Za-z_])", text)]
        literals = [w for w in sorted(names | kinds | {"independent", "own"}) if re.search(rf"[\"']{w}[\"']", text)]
        flat = re.findall(r"\b(?:sgt|prp|guide)_[a-z_]+", text)
        assert not (words or literals or flat), f"{f} names {words} {literals} {flat}"


def test_the_worker_names_no_record_kind_a_step_owns_and_builds_no_steps_context():
    """What a step reads beyond its own groups and peer rows it gathers itself (its ``gather`` hook):
    the worker names no record kind a registered step reads, and holds no replay of its own."""
    owned = set().union(*(parse_strategy(n).reads for n in available_strategies()))
    assert owned  # the check has something to find
    text = re.sub(r"fault_point\([^)]*\)", "", (PACKAGE / "run/worker.py").read_text())  # fault points' names
    named = [k for k in sorted(owned) if re.search(rf"[\"']{k}[\"']", text)]
    assert not named, f"run/worker.py names record kinds {named}"
    for word in ("_history", "PastFailure", "PastSuccess", "Replay", "replay_steps"):
        assert word not in text, f"run/worker.py holds a step's context ({word})"


# ----------------------------------------------------------------------------- a step of your own
@register_loss("test_focal_likelihood", reduction="per_prompt")
def _focal_likelihood(x: TermInputs):
    """A new loss term: likelihood weighted by (1 - p) per token, so confident tokens weigh less."""
    m = x.mask.to(x.logp.dtype)
    lengths = m.sum(1, keepdim=True).clamp(min=1.0)
    focal = (1 - x.logp.detach().exp()) ** x.row_weight.unsqueeze(1)
    return -focal * x.logp / lengths, {"focal_mean": float((focal * m).sum() / m.sum().clamp(min=1.0))}


@dataclass
class RepeatSettings:
    gamma: float = bounded(2.0, ge=0)
    learning_rate: float | None = bounded(5e-3, gt=0)


@register_strategy("test_repeat_best", settings=RepeatSettings,
                   rows={"test_best": RowKind("test_focal_likelihood", learning_rate=lambda s: s.learning_rate)})
def _repeat_best(ctx, batch, s):
    """Its own best success of each solved prompt, trained by the focal term in a step of its own."""
    for g in ctx.groups:
        if not g.failed:
            best = max(range(len(g.scores)), key=g.scores.__getitem__)
            batch.rows.append(TrainRow(g.prompt_ids, list(g.completion_ids[best]), 0.0, None, "test_best", None,
                                       s.gamma))


def test_a_new_step_with_a_new_loss_is_one_module_and_one_registry_line(tiny_config):
    """The docs' "a step of your own": a new loss term and a step that declares its rows, settings
    and optimizer phase train through the unchanged update and worker."""
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(tiny_config, steps=2, eval_every=100, checkpoint_every=100, scheduler="sequential", threads=1,
               policies=[{"name": "g", "model": "zoo:gpt2-add"}, {"name": "l", "model": "zoo:llama-sub"}],
               task={"preset": "zoo", "test_size": 20, "train_size": 200},
               grpo={"num_generations": 4, "max_completion_length": 6},
               sharing={"strategy": "test_repeat_best", "test_repeat_best": {"gamma": 1.5}})
    with pytest.raises(ConfigError) as info:
        load_config(dict(cfg, sharing={"strategy": "test_repeat_best", "test_repeat_best": {"gamma": -1}}))
    assert info.value.field == "sharing.test_repeat_best.gamma"
    tr = MutualTrainer(cfg, None, progress=False)
    tr.train()
    rows = [r for r in tr.history if r.get("event") != "eval"]
    assert rows and all(r["optimizer_steps"] == ("grad_norm" in r) + ("test_repeat_best_loss" in r) for r in rows)
    assert any("test_best_focal_mean" in r and "test_repeat_best_grad_norm" in r for r in rows)


# ----------------------------------------------------------------------------- chain order
@register_strategy("test_drop_failed", breaks=(OWN_GROUPS,))
def _drop_failed(ctx, batch):
    """Drops the own rows of failed groups (it breaks what pooling steps need)."""
    batch.rows = [r for r in batch.rows if r.kind != "own" or r.advantage != 0.0]


def _groups(task):
    probs = task.problems("train", 2)
    return [OwnGroup(p, [1, 2], [[5], [6]], [[-1.0], [-1.0]], list(r), list(r))
            for p, r in zip(probs, [(0.0, 0.0), (1.0, 0.0)], strict=True)]


@pytest.fixture(scope="module")
def task(small_zoo_task):
    return small_zoo_task


def test_a_chain_is_ordered_by_what_each_step_needs_and_breaks():
    # prp needs the own groups intact: a step that breaks them runs after it, whatever the order given
    assert parse_strategy("test_drop_failed+prp").name == "prp+test_drop_failed"
    assert parse_strategy("prp+test_drop_failed").name == "prp+test_drop_failed"
    # steps without constraints keep the order given
    assert parse_strategy("imitate+prp").name == "imitate+prp"
    assert parse_strategy("prp+imitate").name == "prp+imitate"


def test_a_need_nobody_provides_and_a_cycle_are_refused():
    @register_strategy("test_needs_pooled", needs=("pooled_advantages",))
    def _needs(ctx, batch):
        """Reads pooled advantages."""

    @register_strategy("test_pools_and_breaks", provides=("pooled_advantages",), needs=(OWN_GROUPS,),
                       breaks=("pooled_advantages",))
    def _both(ctx, batch):
        """Provides what it then breaks."""
    try:
        with pytest.raises(StrategyError, match="needs pooled_advantages.*chain it with"):
            parse_strategy("test_needs_pooled")
        assert parse_strategy("test_needs_pooled+xgrpo").name == "xgrpo+test_needs_pooled"
        with pytest.raises(StrategyError, match="no order"):
            parse_strategy("test_needs_pooled+test_pools_and_breaks")
    finally:
        unregister_strategy("test_needs_pooled")
        unregister_strategy("test_pools_and_breaks")


def test_one_pooling_for_every_pooling_step(task):
    """xgrpo, prp and guide rewrite own advantages through the one pooled-advantage function."""
    from mutualrl.algorithms.strategies import guide, prp, xgrpo

    for mod in (guide, prp, xgrpo):
        src = Path(mod.__file__).read_text()
        assert "pool_with_peers(" in src and "pooled_advantages(" not in src, mod.__name__


def test_a_step_adding_rows_of_an_undeclared_kind_is_an_error(task):
    @register_strategy("test_undeclared")
    def _bad(ctx, batch):
        """Adds a row of a kind it never declared."""
        batch.rows.append(TrainRow([1], [2], 0.0, None, "mystery"))
    try:
        ctx = ShareContext(_groups(task), PeerRows(), GRPOOptions(dynamic_sampling="off"),
                           lambda ps, cs: ([0.0] * len(cs), [0.0] * len(cs)), lambda ids, t: [1])
        with pytest.raises(StrategyError, match="undeclared kinds"):
            build_batch("test_undeclared", ctx)
        assert [len(x) for x in own_rows_by_prompt(build_batch("independent", ctx), ctx.groups)] == [2, 2]
    finally:
        unregister_strategy("test_undeclared")


# ----------------------------------------------------------------------------- settings blocks
def test_flat_names_of_earlier_releases_still_work_with_a_warning(tiny_config):
    cfg = dict(tiny_config, sharing={"strategy": "imitate", "sgt_learning_rate": 3e-4, "sgt_lambda": 1.0})
    with pytest.warns(FutureWarning, match=r"sharing\.sgt_learning_rate -> .*sharing\.imitate\.learning_rate"):
        c = load_config(cfg)
    s = parse_strategy("imitate").settings(c.sharing)["imitate"]
    assert (s.learning_rate, s.weight) == (3e-4, 1.0)
    with pytest.raises(ConfigError, match="not both"):
        load_config(dict(tiny_config, sharing={"strategy": "imitate", "sgt_lambda": 1.0,
                                               "imitate": {"weight": 0.5}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new shape warns of nothing, and reads back equal
        c2 = load_config(dict(tiny_config, sharing={"strategy": "imitate", "imitate": {"learning_rate": 3e-4}}))
        assert load_config(c2.to_dict()) == c2
    assert c2.to_dict()["sharing"]["imitate"] == {"learning_rate": 3e-4}


def test_a_step_that_reads_no_peer_runs_with_one_policy(tiny_config):
    one = dict(tiny_config, policies=tiny_config["policies"][:1])
    assert load_config(dict(one, sharing={"strategy": "self_imitate"})).sharing.strategy == "self_imitate"
    with pytest.raises(ConfigError, match="reads the peers"):
        load_config(dict(one, sharing={"strategy": "imitate"}))


def _ctx_with_own_history(task):
    """This step's two groups (one solved), every text encodable, and three own successes of an
    earlier step: (the context, those earlier problems)."""
    from mutualrl.algorithms.strategies.imitate import SelfImitateStep

    older = task.problems("train")[5:8]
    ctx = ShareContext(_groups(task), PeerRows(), GRPOOptions(dynamic_sampling="off"),
                       lambda ps, cs: ([1.0] * len(cs), [1.0] * len(cs)), lambda ids, t: [ord(c) for c in t] + [0],
                       gathered={})
    past = Replay(successes=[PastSuccess(p, [9], p.answer, 0) for p in older])
    ctx.gathered = {"imitate": past, "self_imitate": SelfImitateStep(past)}  # what each step's gather returns
    return ctx, older


def test_self_imitate_extra_rows_come_from_own_earlier_successes(task):
    ctx, older = _ctx_with_own_history(task)
    plain = build_batch("self_imitate", ctx)
    assert sum(r.kind == "self_imitate" for r in plain.rows) == 1  # one solved prompt this step
    matched = build_batch("self_imitate", ctx, {"self_imitate": {"extra_rows": 2, "replay_steps": 3}})
    extra = [r for r in matched.rows if r.kind == "self_imitate"][1:]
    assert [r.completion_ids for r in extra] == [[ord(c) for c in p.answer] + [0] for p in older[:2]]
    assert matched.metrics["self_imitate_extra"] == 2
    # matching tokens: extra rows only until the step trains that many (4 own GRPO tokens + 1 own success)
    first = len(older[0].answer) + 1
    budget = {"self_imitate": {"extra_rows": 3, "replay_steps": 3, "match_tokens": 5 + first + 1}}
    tokens = build_batch("self_imitate", ctx, budget)
    assert tokens.metrics["self_imitate_extra"] == 2  # one short of the budget after the first, past it after two


def test_imitate_own_extra_rows_are_the_controls_rows_under_imitates_kind(task):
    """imitate with own_extra_rows trains the same own earlier successes its compute-matched control
    (self_imitate with extra_rows) would, so at equal tokens the arms differ by the peers' rows only."""
    ctx, older = _ctx_with_own_history(task)
    plain = build_batch("imitate", ctx)
    assert "imitate_own_extra" not in plain.metrics and sum(r.kind == "imitate" for r in plain.rows) == 1
    both = {"extra_rows": 2, "replay_steps": 3}
    ours = build_batch("imitate", ctx, {"imitate": {"own_extra_rows": 2, "replay_steps": 3}})
    control = build_batch("self_imitate", ctx, {"self_imitate": both})
    assert ours.metrics["imitate_own_extra"] == 2
    assert [r.completion_ids for r in ours.rows if r.kind == "imitate"] == \
        [r.completion_ids for r in control.rows if r.kind == "self_imitate"]
    first = len(older[0].answer) + 1
    capped = build_batch("imitate", ctx, {"imitate": {"own_extra_rows": 3, "replay_steps": 3,
                                                      "match_tokens": 5 + first + 1}})
    assert capped.metrics["imitate_own_extra"] == 2  # the control's token budget rule, the same count


def test_user_steps_register_in_worker_processes_through_sharing_modules(tiny_config, tmp_path, monkeypatch):
    """A step registered in the user's own module runs under the local scheduler: every worker
    process imports ``sharing.modules`` before it parses the strategy."""
    from mutualrl.run.trainer import MutualTrainer

    (tmp_path / "my_steps_mod.py").write_text(
        "from mutualrl.algorithms.sharing import register_strategy\n"
        "@register_strategy('test_user_noop')\n"
        "def noop(ctx, batch):\n"
        "    '''Adds nothing.'''\n"
        "    batch.metrics['test_user_noop_ran'] = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    cfg = dict(tiny_config, steps=1, eval_every=100, checkpoint_every=100, scheduler="local", threads=1,
               sharing={"strategy": "test_user_noop", "modules": ["my_steps_mod"]})
    with pytest.raises(ConfigError) as info:
        load_config(dict(cfg, sharing={"strategy": "x", "modules": ["no_such_module_q"]}))
    assert info.value.field == "sharing.modules[0]"
    try:
        tr = MutualTrainer(cfg, None, progress=False)
        tr.train()
        assert all(r.get("test_user_noop_ran") == 1.0 for r in tr.history if r.get("event") != "eval")
    finally:
        unregister_strategy("test_user_noop")


def test_the_update_sums_terms_over_whole_batch_counts(tiny_models):
    """Two kinds in one policy-gradient reduction sum to the loss of one pass over both: the own
    rows' and the peer rows' shares use the counts of the whole batch, not their own."""
    from mutualrl.algorithms.grpo import grpo_loss
    from mutualrl.algorithms.losses import BatchCounts, clipped_surrogate, off_policy_pg, reduce

    torch.manual_seed(0)
    logp = -torch.rand(4, 5, dtype=torch.float64)
    old = logp + 0.05 * torch.randn(4, 5, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, :2] = False
    off = torch.tensor([False, False, True, True])
    w = torch.full((4, 5), 0.7, dtype=torch.float64)
    for lt in ("grpo", "bnpo", "dr_grpo"):
        opts = GRPOOptions(loss_type=lt, max_completion_length=5)
        whole = grpo_loss(logp, old, adv, mask, loss_type=lt, max_completion_length=5, is_weight=w,
                          offpolicy=off).loss
        counts = BatchCounts(4, int(mask.sum()), 2)
        rw = torch.ones(2, dtype=torch.float64)
        a, _ = clipped_surrogate(TermInputs(logp[:2], mask[:2], adv[:2], rw, opts, old_logp=old[:2]))
        b, _ = off_policy_pg(TermInputs(logp[2:], mask[2:], adv[2:], rw, opts, token_weight=w[2:]))
        parts = reduce(a, mask[:2], "policy_gradient", counts, opts) + reduce(b, mask[2:], "policy_gradient",
                                                                               counts, opts)
        assert float(parts) == pytest.approx(float(whole), rel=1e-12), lt


def test_the_strategy_list_the_cli_shows_is_the_registry(tmp_path, monkeypatch, capsys):
    """``mutualrl strategies`` lists every registered step (a user's too, with ``--module``) with its
    settings block; the help of ``--strategy`` and ``--set`` names no list that can go stale."""
    from mutualrl.cli import build_parser, main
    from mutualrl.config import RESUMABLE

    (tmp_path / "my_listed_steps.py").write_text(
        "from mutualrl.algorithms.sharing import register_strategy\n"
        "@register_strategy('test_listed_noop')\n"
        "def noop(ctx, batch):\n"
        "    '''Adds nothing. Second sentence not shown.'''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["strategies", "--module", "my_listed_steps"]) == 0
        out = capsys.readouterr().out
        names = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
        assert names == available_strategies() and "test_listed_noop" in names
        assert "test_listed_noop: Adds nothing.\n" in out and "settings (sharing.imitate): weight" in out
    finally:
        unregister_strategy("test_listed_noop")
    assert main(["strategies", "--module", "no_such_module_z"]) == 2
    train = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert all(f in " ".join(train.split()) for f in RESUMABLE)


@pytest.mark.parametrize("block,field", [({"imitate": {"own_extra_rows": 4}}, "sharing.imitate.own_extra_rows"),
                                         ({"self_imitate": {"extra_rows": 4}}, "sharing.self_imitate.extra_rows")])
def test_earlier_own_rows_without_replay_steps_are_refused_naming_the_field(tiny_config, block, field):
    """Earlier own successes come from the last ``replay_steps`` steps: asking for them with none is
    refused at load time, naming the field and the fix, instead of silently adding nothing."""
    from mutualrl.config.resolve import load_config
    from mutualrl.errors import ConfigError

    strategy = next(iter(block))
    with pytest.raises(ConfigError) as exc:
        load_config(dict(tiny_config, sharing={"strategy": strategy, **block}), check_paths=False)
    assert exc.value.field == field and "replay_steps >= 1" in str(exc.value)
    load_config(dict(tiny_config, sharing={"strategy": strategy, strategy: {**block[strategy], "replay_steps": 2}}),
                check_paths=False)
