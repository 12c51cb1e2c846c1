"""Typed experience records: encoding round-trips, validation, and robustness to hostile input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mutualrl.experience import (
    REASONS,
    ExperienceLimits,
    GroupOutcome,
    InvalidExperience,
    Rollout,
    VerifiedSuccess,
    from_dict,
    from_row,
    parse,
    to_row,
    validate,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.text(min_size=1, max_size=24)
texts = st.text(max_size=200)
versions = st.integers(min_value=0, max_value=2**40)
stamps = st.floats(min_value=0, max_value=4e9, allow_nan=False)
rewards = st.floats(min_value=-5, max_value=5, allow_nan=False)


@st.composite
def rollouts(draw: st.DrawFn) -> Rollout:
    n = draw(st.integers(min_value=0, max_value=40))
    toks = draw(st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=n, max_size=n))
    lps = draw(st.lists(st.floats(min_value=-1e4, max_value=0), min_size=n, max_size=n))
    return Rollout(draw(ids), draw(texts), draw(texts), draw(ids), draw(ids), toks, lps, draw(rewards),
                   draw(versions), draw(st.integers(min_value=0, max_value=1024)), draw(stamps))


@st.composite
def groups(draw: st.DrawFn) -> GroupOutcome:
    rs = draw(st.lists(rewards, min_size=1, max_size=16))
    return GroupOutcome.from_rewards(draw(ids), draw(ids), rs, draw(versions), created_at=draw(stamps))


@st.composite
def successes(draw: st.DrawFn) -> VerifiedSuccess:
    return VerifiedSuccess(draw(ids), draw(texts), draw(ids), draw(ids), draw(rewards), draw(versions),
                           draw(stamps))


records = st.one_of(rollouts(), groups(), successes())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _assert_valid_or_reason(obj: object) -> None:
    try:
        rec = parse(obj)  # type: ignore[arg-type]
    except InvalidExperience as exc:
        assert exc.reason in REASONS, exc.reason
        return
    validate(rec)
    assert parse(rec.to_json()) == rec


@SETTINGS
@given(records)
def test_json_and_msgpack_round_trip(rec: object) -> None:
    for wire in (rec.to_json(), rec.to_json().encode("utf-8"), rec.to_msgpack(), rec.to_dict()):
        back = parse(wire)
        assert back == rec
        assert back.record_id == rec.record_id
        assert back.created_at == rec.created_at  # not part of equality, but kept
        assert type(back) is type(rec)
    assert from_row(*to_row(rec)) == rec
    assert from_dict(rec.to_dict()) == rec


@SETTINGS
@given(records, st.data())
def test_field_mutations_are_parsed_or_rejected_with_a_reason(rec: object, data: st.DataObject) -> None:
    d = rec.to_dict()
    keys = sorted(d)
    op = data.draw(st.sampled_from(["replace", "delete", "add", "element", "numeric"]))
    if op == "replace":
        d[data.draw(st.sampled_from(keys))] = data.draw(json_values)
    elif op == "delete":
        del d[data.draw(st.sampled_from(keys))]
    elif op == "add":
        d[data.draw(st.text(max_size=10))] = data.draw(json_values)
    elif op == "element":
        lists = [k for k in keys if isinstance(d[k], list) and d[k]]
        if lists:
            k = data.draw(st.sampled_from(lists))
            d[k][data.draw(st.integers(0, len(d[k]) - 1))] = data.draw(json_values)
    else:
        nums = [k for k in keys if isinstance(d[k], (int, float))]
        k = data.draw(st.sampled_from(nums))
        d[k] = data.draw(st.one_of(st.floats(), st.integers(), st.integers(min_value=2**63)))
    _assert_valid_or_reason(d)
    try:
        text = json.dumps(d)
    except (ValueError, TypeError):
        return
    _assert_valid_or_reason(text)


@SETTINGS
@given(records, st.data())
def test_byte_mutations_are_parsed_or_rejected_with_a_reason(rec: object, data: st.DataObject) -> None:
    raw = bytearray(data.draw(st.sampled_from([rec.to_json().encode("utf-8"), rec.to_msgpack()])))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and raw:
            del raw[i]
        elif op == "truncate":
            del raw[i:]
    _assert_valid_or_reason(bytes(raw))
    _assert_valid_or_reason(bytes(raw).decode("utf-8", errors="surrogateescape"))


def _rollout(**kw: object) -> Rollout:
    base: dict[str, object] = {"prompt_id": "p1", "prompt": "2+2?", "completion": "4", "source_policy": "A",
                               "source_tokenizer": "tokA", "token_ids": [5, 6], "logprobs": [-0.5, -0.1],
                               "reward": 1.0, "version": 3, "created_at": 100.0}
    base.update(kw)
    return Rollout(**base)  # type: ignore[arg-type]


def _reason(obj: object, limits: ExperienceLimits | None = None) -> str:
    with pytest.raises(InvalidExperience) as exc:
        parse(obj, limits or ExperienceLimits())  # type: ignore[arg-type]
    return exc.value.reason


def _edit(**changes: object) -> dict:
    d = _rollout().to_dict()
    for k, v in changes.items():
        if v is _DEL:
            del d[k]
        else:
            d[k] = v
    return d


_DEL = object()


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ("{not json", "bad_encoding"),
        ("[1, 2]", "bad_encoding"),
        ("[" * 50_000, "too_deep"),
        (b'{"kind": "rollout", "x": "\xff"}', "invalid_utf8"),
        (_edit(kind="trajectory"), "unknown_kind"),
        (_edit(schema_version=2), "schema_version"),
        (_edit(schema_version=True), "schema_version"),
        (_edit(completion=_DEL), "missing_field"),
        (_edit(record_id=_DEL), "missing_field"),
        (_edit(extra=1), "unknown_field"),
        (_edit(reward="1.0"), "wrong_type"),
        (_edit(version=3.0), "wrong_type"),
        (_edit(token_ids=[5, True]), "wrong_type"),
        (_edit(token_ids="56"), "wrong_type"),
        (_edit(reward=math.nan), "non_finite"),
        (_edit(reward=10**400), "non_finite"),
        (_edit(logprobs=[-0.5, -math.inf]), "non_finite"),
        (_edit(logprobs=[-0.5, 0.7]), "logprob_range"),
        (_edit(token_ids=[5, -1]), "token_range"),
        (_edit(version=-1), "version_range"),
        (_edit(version=2**63), "version_range"),
        (_edit(sample_index=-2), "version_range"),
        (_edit(created_at=-1.0), "version_range"),
        (_edit(token_ids=[5]), "length_mismatch"),
        (_edit(prompt_id=""), "empty"),
        (_edit(prompt_id="x" * 1000), "too_large"),
        (_edit(completion="\ud800"), "invalid_utf8"),
        (_edit(completion="5"), "bad_id"),
        (_edit(record_id=7), "bad_id"),
    ],
)
def test_specific_rejections(obj: object, reason: str) -> None:
    assert _reason(obj) == reason


def test_nan_constant_in_json_text_is_non_finite() -> None:
    text = _rollout().to_json().replace('"reward":1.0', '"reward":NaN')
    assert _reason(text) == "non_finite"


def test_limits_from_the_task() -> None:
    r = _rollout()
    limits = ExperienceLimits(reward_range=(0.0, 0.5), known_prompt_ids=frozenset({"p1"}),
                              vocab_sizes={"tokA": 6})
    assert _reason(r.to_json(), ExperienceLimits(reward_range=(0.0, 0.5))) == "reward_range"
    assert _reason(r.to_json(), ExperienceLimits(known_prompt_ids=frozenset({"p2"}))) == "unknown_prompt"
    assert _reason(r.to_json(), ExperienceLimits(vocab_sizes={"tokA": 6})) == "token_range"
    assert parse(r.to_json(), ExperienceLimits(vocab_sizes={"tokA": 7, "other": 2})) == r
    assert _reason(r.to_json(), ExperienceLimits(max_tokens=1)) == "too_large"
    assert _reason(r.to_json(), ExperienceLimits(max_text_chars=2)) == "too_large"
    assert _reason(r.to_json(), ExperienceLimits(max_record_bytes=50)) == "too_large"
    g = GroupOutcome.from_rewards("p1", "A", [0.0, 1.0, 1.0], 1)
    assert _reason(g.to_json(), ExperienceLimits(max_group_size=2)) == "too_large"
    assert _reason(g.to_json(), limits) == "reward_range"
    assert ExperienceLimits.from_dict(json.loads(json.dumps(limits.to_dict()))) == limits
    assert ExperienceLimits.from_dict(ExperienceLimits().to_dict()) == ExperienceLimits()


def test_group_outcome_statistics_must_match() -> None:
    g = GroupOutcome.from_rewards("p1", "A", [0.0, 1.0], 2)
    assert (g.mean, g.std) == (0.5, 0.5)
    d = g.to_dict()
    d["mean"] = 0.9
    assert _reason(d) == "inconsistent"  # checked before the id
    assert _reason(GroupOutcome("p1", "A", [], 0.0, 0.0, 1).to_dict()) == "empty"


def test_record_id_is_content_derived() -> None:
    a = _rollout(created_at=1.0)
    assert a.record_id == _rollout(created_at=2.0).record_id  # timestamps are not content
    assert a.record_id != _rollout(sample_index=1).record_id  # same text, another sample
    assert a.record_id != _rollout(logprobs=[-0.5, -0.2]).record_id
    assert a.record_id != _rollout(token_ids=[6, 5]).record_id
    assert len(a.record_id) == 64 and int(a.record_id, 16) >= 0
    v = VerifiedSuccess("p1", "4", "A", "exact", 1.0, 3)
    assert v.record_id != VerifiedSuccess("p1", "4", "B", "exact", 1.0, 3).record_id


def test_records_are_frozen_and_normalised() -> None:
    r = _rollout(reward=1, logprobs=[0, -1])
    assert isinstance(r.reward, float) and r.logprobs == (0.0, -1.0) and r.token_ids == (5, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.reward = 0.0  # type: ignore[misc]
    assert hash(r) == hash(_rollout(reward=1.0, logprobs=(0.0, -1.0)))
    assert Rollout.SCHEMA_VERSION == 1 and r.kind == "rollout"


def test_parse_rejects_non_input_types() -> None:
    assert _reason(12) == "bad_encoding"
    assert _reason(None) == "bad_encoding"
