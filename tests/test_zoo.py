"""The policy zoo: heterogeneity, HF round trip, SFT, cache and determinism (tiny variants)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mutualrl import zoo
from mutualrl.errors import UserError
from mutualrl.zoo.build import weights_hash


def _tiny(spec: zoo.ZooSpec) -> zoo.ZooSpec:
    """A tiny variant that lands at its first check (step 40): bands that any accuracy satisfies."""
    return dataclasses.replace(spec, n_layer=1, n_embd=32, n_head=2, n_kv_head=0, n_inner=64, sft_max_steps=80,
                               sft_eval_every=40, batch=16, lr=3e-3, max_positions=64,
                               bands={k: (0.0, 1.0) for k in spec.bands}, band_margin=0.0, generalist_target=0.0)


TINY = {name: _tiny(spec) for name, spec in zoo.ZOO.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("zoo")
    dirs = zoo.build_zoo(list(TINY), seed=0, cache_dir=cache, progress=False, specs=TINY)
    return cache, dirs


def test_heterogeneous_and_hf_round_trip(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    _, dirs = built
    model_types, tok_models, vocab_sizes = set(), set(), set()
    for name, path in dirs.items():
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "zoo_card.json"):
            assert (path / f).is_file(), (name, f)
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert isinstance(tok, PreTrainedTokenizerFast)
        assert None not in (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
        assert tok.pad_token_id != tok.eos_token_id
        assert model.config.vocab_size == len(tok)
        card = zoo.load_card(path)
        assert card["vocab_size"] == len(tok)
        assert weights_hash(model) == card["weights_sha256"]  # saved == trained weights
        assert card["sft_steps_done"] == 40 and card["landed_val_accuracy"] == card["sft_val_history"][-1]["val"]
        # prompt and answer tokenize independently, digits are single tokens, text round-trips
        prompt, answer = zoo.format_prompt("Calculate 18 - 42."), "-24"
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        a_ids = tok(answer, add_special_tokens=False).input_ids
        assert p_ids + a_ids == tok(prompt + answer, add_special_tokens=False).input_ids
        assert tok.decode(a_ids) == answer and tok.decode(p_ids + a_ids) == prompt + answer
        assert tok.convert_ids_to_tokens(a_ids)[-2:] == ["2", "4"]
        model_types.add(model.config.model_type)
        tok_models.add(type(tok.backend_tokenizer.model).__name__)
        vocab_sizes.add(len(tok))
        assert set(card["accuracy_greedy"]) == {"add", "sub"}
        assert card["n_test_per_type"] == {"add": 500, "sub": 500}
    assert len(model_types) == len(tok_models) == len(vocab_sizes) == len(dirs) >= 3


def test_sft_loss_goes_down(built):
    _, dirs = built
    for path in dirs.values():
        card = zoo.load_card(path)
        assert card["sft_loss_last"] < 0.8 * card["sft_loss_first"], card


def test_cache_hit_and_determinism(built, tmp_path):
    cache, dirs = built
    stamps = {p: p.stat().st_mtime_ns for d in dirs.values() for p in d.iterdir()}
    again = zoo.build_zoo(list(TINY), seed=0, cache_dir=cache, progress=False, specs=TINY)
    assert again == dirs  # a cache hit: nothing is built or written again
    assert {p: p.stat().st_mtime_ns for d in dirs.values() for p in d.iterdir()} == stamps
    # same seed, fresh cache: identical weights (the fixture built the policies at once, one child
    # process each; this builds one alone, in this process)
    one = {"gpt2-add": TINY["gpt2-add"]}
    same = zoo.build_zoo(["gpt2-add"], seed=0, cache_dir=tmp_path, progress=False, specs=one)
    card0 = zoo.load_card(dirs["gpt2-add"])
    assert zoo.load_card(same["gpt2-add"])["weights_sha256"] == card0["weights_sha256"]
    assert json.loads((same["gpt2-add"] / "tokenizer.json").read_text()) == \
        json.loads((dirs["gpt2-add"] / "tokenizer.json").read_text())
    assert not list(tmp_path.glob("*/.tmp-*"))  # no temporary folder left behind


def test_spec_hash_and_errors(tmp_path):
    spec = zoo.ZOO["gpt2-add"]
    assert spec.cache_key(0) != spec.cache_key(1)
    assert spec.cache_key(0) != dataclasses.replace(spec, sft_max_steps=1).cache_key(0)
    assert spec.cache_key(0) != spec.cache_key(0, task_key="abc")
    with pytest.raises(UserError, match="valid"):
        zoo.build_zoo(["nope"], cache_dir=tmp_path, progress=False)
    with pytest.raises(UserError):
        zoo.zoo_model_dir("nope", cache_dir=tmp_path)


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="mutualrl")
    zoo.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli(tmp_path, capsys):
    args = _parse(["zoo", "list", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert all(f"zoo:{name}" in out for name in zoo.ZOO)
    args = _parse(["zoo", "build", "--names", "nope", "--cache-dir", str(tmp_path)])
    with pytest.raises(UserError, match="nope"):
        args.func(args)


def test_sft_lands_in_band():
    import torch

    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.sft import in_band, sft
    from mutualrl.zoo.tokenizers import train_tokenizer

    spec = dataclasses.replace(TINY["gpt2-add"], sft_eval_every=5)
    task = zoo.default_task(0, test_size=10, train_size=2000)
    tok = train_tokenizer(spec.tokenizer, corpus(task, limit=500), spec.vocab_size)
    torch.manual_seed(0)
    res = sft(zoo.build_model(spec, tok), tok, task, spec, 0)
    assert res.landed and len(res.losses) == 5 and [h["step"] for h in res.history] == [5]
    banded = dataclasses.replace(spec, bands={"add": (0.3, 0.5), "sub": (0.03, 0.15)})
    assert in_band(banded, {"add": 0.4, "sub": 0.1}) and not in_band(banded, {"add": 0.55, "sub": 0.1})
    # the margin is a share of each band's width: 30-50 % with 0.15 is 33-47 %
    assert not in_band(banded, {"add": 0.32, "sub": 0.1}, 0.15) and in_band(banded, {"add": 0.34, "sub": 0.1}, 0.15)


def _scripted_sft(monkeypatch, script, **spec_over):
    """SFT of a tiny gpt2-add with validation accuracies taken from ``script`` (add 30-50 %, sub
    3-15 %, margin 15 %: inside means add 33-47 % and sub 4.8-13.2 %); the weights at each check."""
    import copy

    import torch

    import mutualrl.zoo.sft as sft_module
    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.sft import sft
    from mutualrl.zoo.tokenizers import train_tokenizer

    over = {"bands": {"add": (0.3, 0.5), "sub": (0.03, 0.15)}, "band_margin": 0.15,
            "sft_mixture": {"add": 0.8, "sub": 0.2}, **spec_over}
    spec = dataclasses.replace(TINY["gpt2-add"], sft_eval_every=10, sft_max_steps=10 * max(6, len(script)), **over)
    it = iter(script)
    monkeypatch.setattr(sft_module, "accuracy", lambda *a, **k: dict(next(it)))  # where sft looks it up
    task = zoo.default_task(0, test_size=10, train_size=2000)
    tok = train_tokenizer(spec.tokenizer, corpus(task, limit=500), spec.vocab_size)
    torch.manual_seed(0)
    model = zoo.build_model(spec, tok)
    seen = {}

    def on_step(step, loss, check):
        if check is not None:
            seen[check["step"]] = copy.deepcopy(model.state_dict())

    return sft(model, tok, task, spec, 0, on_step), seen, model


def test_one_check_above_the_band_is_a_swing_and_training_goes_on(monkeypatch):
    res, _, _ = _scripted_sft(monkeypatch, [{"add": 0.10, "sub": 0.02}, {"add": 0.60, "sub": 0.02},
                                            {"add": 0.40, "sub": 0.08}])
    assert res.landed and not res.steering and len(res.losses) == 30 and res.mixture == {"add": 0.8, "sub": 0.2}


def test_an_overshoot_steers_the_mixture_and_the_warm_start_lands(monkeypatch):
    """Two checks in a row above the band start steering: checks every STEER_EVERY steps, the
    share of a type above its band halved, of one below it 1.5x, never under MIN_SHARE; two checks
    in a row with every type inside land."""
    from mutualrl.zoo.sft import MIN_SHARE, STEER_EVERY

    assert STEER_EVERY == 10  # the scripted spec checks every 10 steps already; steering keeps that
    script = [{"add": 0.10, "sub": 0.02},   # step 10: below: plain SFT
              {"add": 0.60, "sub": 0.02},   # step 20: above (could be a swing)
              {"add": 0.65, "sub": 0.02},   # step 30: above again: steer
              {"add": 0.70, "sub": 0.03},   # step 40: still above: steer again
              {"add": 0.40, "sub": 0.03},   # step 50: add inside, sub below: feed sub
              {"add": 0.40, "sub": 0.08},   # step 60: in band, once: a steered model may be passing through
              {"add": 0.44, "sub": 0.07}]   # step 70: in band again (steered margin: add 35-45 %): lands
    res, _, _ = _scripted_sft(monkeypatch, script)
    assert res.landed and len(res.losses) == 70
    assert [h["step"] for h in res.history] == [10, 20, 30, 40, 50, 60, 70]
    assert [(s["step"], s["above"], s["below"]) for s in res.steering] == [
        (30, ["add"], ["sub"]), (40, ["add"], ["sub"]), (50, [], ["sub"])]
    m1 = {"add": 0.4 / 0.7, "sub": 0.3 / 0.7}   # add 0.8 x 0.5, sub 0.2 x 1.5, renormalised
    assert all(abs(res.steering[0]["mixture"][k] - v) < 1e-9 for k, v in m1.items())
    m2 = {"add": m1["add"] * 0.5, "sub": m1["sub"] * 1.5}
    m2 = {k: v / sum(m2.values()) for k, v in m2.items()}   # sub 0.69
    m3 = {"add": m2["add"], "sub": m2["sub"] * 1.5}         # add waits inside its band: unchanged weight
    m3 = {k: v / sum(m3.values()) for k, v in m3.items()}   # sub 0.77
    for got, want in zip(res.steering[1:], (m2, m3), strict=True):
        assert all(abs(got["mixture"][k] - v) < 1e-9 for k, v in want.items())
    assert min(res.mixture.values()) >= MIN_SHARE
    assert res.mixture == res.steering[-1]["mixture"] and abs(sum(res.mixture.values()) - 1) < 1e-12


def test_steering_never_takes_a_type_out(monkeypatch):
    """However long a type stays above its band, it keeps MIN_SHARE of the mixture."""
    from mutualrl.zoo.sft import MIN_SHARE

    res, _, _ = _scripted_sft(monkeypatch, [{"add": 0.9, "sub": 0.02}] * 6)
    assert not res.landed and len(res.steering) == 5
    assert abs(res.mixture["add"] - MIN_SHARE) < 1e-9 and abs(sum(res.mixture.values()) - 1) < 1e-12


def test_a_warm_start_that_never_overshoots_twice_is_the_plain_one(monkeypatch):
    """Steering changes nothing until two checks in a row are above: the same weights as SFT
    whose checks all pass through."""
    import torch

    script = [{"add": 0.10, "sub": 0.02}, {"add": 0.60, "sub": 0.02}, {"add": 0.20, "sub": 0.02},
              {"add": 0.40, "sub": 0.08}]
    res, _, model = _scripted_sft(monkeypatch, script)
    res2, _, model2 = _scripted_sft(monkeypatch, [{"add": 0.10, "sub": 0.02}] * 3 + [{"add": 0.40, "sub": 0.08}])
    assert res.landed and res2.landed and not res.steering and len(res.losses) == len(res2.losses) == 40
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_build_that_misses_its_band_fails_and_writes_nothing(tmp_path, capsys):
    from mutualrl.zoo.sft import ZooBandError

    spec = dataclasses.replace(TINY["gpt2-add"], sft_max_steps=10, sft_eval_every=5,
                               bands={"add": (0.99, 1.0), "sub": (0.0, 1.0)})
    with pytest.raises(ZooBandError) as exc:
        zoo.build_zoo(["gpt2-add"], cache_dir=tmp_path, progress=False, specs={"gpt2-add": spec})
    msg = str(exc.value)
    assert "did not land" in msg and "add" in msg and "99%" in msg and "10 SFT steps" in msg
    assert not any(p.name == "gpt2-add" for p in tmp_path.rglob("*"))  # nothing in the cache


def test_policies_built_at_once_report_a_missed_band_and_write_only_what_landed(tmp_path):
    from mutualrl.zoo.sft import ZooBandError

    missing = dataclasses.replace(TINY["gpt2-add"], sft_max_steps=10, sft_eval_every=5,
                                  bands={"add": (0.99, 1.0), "sub": (0.0, 1.0)})
    assert zoo.ZooSpec.from_dict(json.loads(json.dumps(missing.to_dict()))) == missing
    specs = {"gpt2-add": missing, "llama-sub": TINY["llama-sub"]}
    with pytest.raises(ZooBandError) as exc:
        zoo.build_zoo(["gpt2-add", "llama-sub"], cache_dir=tmp_path, progress=False, specs=specs, jobs=2)
    msg = str(exc.value)
    assert "'gpt2-add' did not land" in msg and "99%" in msg and "10 SFT steps" in msg
    assert not any(p.name == "gpt2-add" for p in tmp_path.rglob("*"))  # nothing of the miss
    assert zoo.is_built(zoo.policy_dir("llama-sub", 0, tmp_path, specs["llama-sub"]))  # the other landed


def test_zoo_build_for_a_user_task_file(tmp_path, monkeypatch):
    import yaml

    from mutualrl.zoo.cli import task_specs

    monkeypatch.setitem(zoo.ZOO, "gpt2-add", TINY["gpt2-add"])
    ops = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_parentheses": False,
           "allow_negation": False}
    cfg = {"task": {"datasets": [{"name": "basic_arithmetic", "alias": "mul", "config": dict(ops, operators=["*"])},
                                 {"name": "basic_arithmetic", "alias": "add", "config": dict(ops, operators=["+"])}],
                    "test_size": 40, "train_size": 1500},
           "zoo": [{"name": "gpt2-mul", "like": "gpt2-add", "sft_mixture": {"mul": 0.8, "add": 0.2},
                    "bands": {"mul": [0.0, 1.0], "add": [0.0, 1.0]}}]}
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(cfg))
    task, specs, _ = task_specs(path)
    dirs = zoo.build_zoo(["gpt2-mul"], cache_dir=tmp_path / "cache", progress=False, specs=specs, task=task)
    card = zoo.load_card(dirs["gpt2-mul"])
    assert set(card["accuracy_greedy"]) == {"mul", "add"} and card["task_key"]
    bad = dict(cfg, zoo=[{"name": "x", "sft_mixture": {"div": 1.0}, "bands": {"mul": [0, 1], "add": [0, 1]}}])
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(UserError, match="div"):
        task_specs(path)
    # too few problems: the build's 500 validation problems would leave almost nothing to train on
    small = dict(cfg, task=dict(cfg["task"], train_size=800))
    path.write_text(yaml.safe_dump(small))
    with pytest.raises(UserError, match=r"'mul' has [0-9]+ training problems.*700 in all") as info:
        task_specs(path)
    assert info.value.field == "task.datasets[0]"
    # the Python API refuses the same task before it trains or writes anything
    from mutualrl.config.resolve import resolve_task
    from mutualrl.tasks.build import build_task
    from mutualrl.zoo.steps import TooFewProblems

    small_task = build_task(resolve_task(small["task"]))
    with pytest.raises(TooFewProblems, match="'mul' has") as info:
        zoo.build_zoo(["gpt2-mul"], cache_dir=tmp_path / "cache2", progress=False, specs=specs, task=small_task)
    assert info.value.index == 0 and not (tmp_path / "cache2").exists()


def test_steer_keeps_a_floor_for_many_types():
    from mutualrl.zoo.sft import MIN_SHARE, _steer

    mix = {f"t{i}": 1 / 30 for i in range(30)}
    out = _steer(mix, above=["t0", "t1"], below=[])
    assert abs(sum(out.values()) - 1) < 1e-12 and min(out.values()) >= min(MIN_SHARE, 0.5 / 30) - 1e-15
    out = _steer({"a": 0.9, "b": 0.06, "c": 0.04}, above=["a"], below=[])
    assert abs(sum(out.values()) - 1) < 1e-12 and min(out.values()) >= MIN_SHARE - 1e-15


def test_a_steered_type_in_its_top_margin_is_fed_less(monkeypatch):
    """Once steering, the landing margin widens to STEER_MARGIN (band 30-50 %: 35-45 %), and a type
    inside its band but above that edge (add 46 %) counts as high: its share is halved."""
    from mutualrl.zoo.sft import STEER_MARGIN

    assert STEER_MARGIN == 0.25
    res, _, _ = _scripted_sft(monkeypatch, [{"add": 0.6, "sub": 0.08}, {"add": 0.6, "sub": 0.08},
                                            {"add": 0.46, "sub": 0.08}, {"add": 0.40, "sub": 0.08},
                                            {"add": 0.40, "sub": 0.08}, {"add": 0.40, "sub": 0.08}])
    assert [(s["step"], s["above"], s["below"]) for s in res.steering] == [(20, ["add"], []), (30, ["add"], [])]
    assert res.landed and len(res.losses) == 50


def test_a_generalist_phase_then_a_specialisation_that_forgets_the_other_skill(monkeypatch):
    """generalist_target: even SFT until every skill reaches it (checks every sft_eval_every), then SFT
    on the own skill alone at a third of the learning rate, checked every STEER_EVERY steps, until the
    other skill has faded into its band."""
    from mutualrl.zoo.sft import SPECIALISE_LR_SCALE

    script = [{"add": 0.10, "sub": 0.10}, {"add": 0.35, "sub": 0.31},   # generalist: both reach 30 % at step 20
              {"add": 0.50, "sub": 0.20}, {"add": 0.60, "sub": 0.04}]   # specialise: sub fades into 0-5 %
    res, _, _ = _scripted_sft(monkeypatch, script, generalist_target=0.3, sft_mixture={"add": 1.0},
                              bands={"add": (0.35, 1.0), "sub": (0.0, 0.05)})
    assert res.landed and res.generalist_steps == 20 and len(res.losses) == 40
    assert [h.get("phase") for h in res.history] == ["generalist", "generalist", "specialise", "specialise"]
    assert res.mixture == {"add": 1.0} and SPECIALISE_LR_SCALE < 1


def test_a_skill_forgotten_below_its_band_gives_up_early(monkeypatch):
    script = [{"add": 0.35, "sub": 0.31}, {"add": 0.50, "sub": 0.01}]
    res, _, _ = _scripted_sft(monkeypatch, script, generalist_target=0.3, sft_mixture={"add": 1.0},
                              bands={"add": (0.35, 1.0), "sub": (0.03, 0.15)})
    assert not res.landed and "sub fell below its band" in res.gave_up and len(res.losses) == 20


def test_a_build_whose_every_skill_overshoots_stops_early(monkeypatch):
    """The AMD failure: every skill above its band and not coming down. The warm start gives up after
    ALL_ABOVE_CHECKS steered checks instead of running to sft_max_steps."""
    from mutualrl.zoo.sft import ALL_ABOVE_CHECKS

    script = [{"add": 0.60, "sub": 0.30}] * (2 + ALL_ABOVE_CHECKS + 5)
    res, _, _ = _scripted_sft(monkeypatch, script)
    assert not res.landed and "above its band" in res.gave_up
    assert len(res.history) == 2 + ALL_ABOVE_CHECKS - 1 < len(script)


def test_the_shipped_policies_are_hash_checked(tmp_path, monkeypatch):
    """The default zoo is shipped built (the same weights on every CPU) and checked by sha256 when
    loaded; a changed file is refused naming it."""
    import shutil

    from mutualrl.zoo import shipped
    from mutualrl.zoo.build import is_shipped, policy_dir

    assert is_shipped("gpt2-add") and is_shipped("llama-sub")
    d = policy_dir("gpt2-add")
    assert d.parent == shipped.SHIPPED_ROOT and zoo.load_card(d)["weights_sha256"] == \
        shipped.manifest()["gpt2-add"]["weights_sha256"]
    assert not is_shipped("gpt2-add", seed=1)  # other build seeds are built locally
    copy = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_ROOT, copy)
    (copy / "gpt2-add" / "config.json").write_text("{}")
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", copy)
    shipped.verified_dir.cache_clear()
    try:
        with pytest.raises(shipped.ShippedWeightsError, match="config.json has sha256"):
            shipped.verified_dir("gpt2-add")
    finally:
        shipped.verified_dir.cache_clear()
