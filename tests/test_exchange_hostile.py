"""Rule 1 of the exchange, on every backend (memory, sqlite, ray): whatever arrives, a row is stored
or refused with a reason; no other exception escapes, and a bad row never costs a good row of its
batch. Hypothesis generates nested, oversized and mistyped rows around honest ones."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mutualrl.exchange import open_exchange
from mutualrl.experience import REASONS, ExperienceLimits, InvalidExperience, Rollout, parse

LIMITS = ExperienceLimits(max_record_bytes=64 * 1024, max_text_chars=2000, max_tokens=256)


def honest(k: int) -> Rollout:
    return Rollout("p1", "prompt", f"answer {k}", "A", "tok", [1, 2, k], [-0.1, -0.2, -0.3], 1.0, 3, sample_index=k)


def nested(depth: int, leaf: object = 1) -> object:
    x = leaf
    for i in range(depth):
        x = [x] if i % 2 else {"k": x}
    return x


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=50), st.binary(max_size=50))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                      max_leaves=20)
FIELDS = list(honest(0).to_dict())


@st.composite
def hostile_dicts(draw) -> dict:
    """An honest row with some fields replaced by arbitrary, deeply nested or huge values."""
    d = honest(draw(st.integers(0, 10**6))).to_dict()
    for name in draw(st.lists(st.sampled_from(FIELDS + ["extra"]), min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["value", "deep", "huge_list", "huge_text", "delete"]))
        if kind == "value":
            d[name] = draw(values)
        elif kind == "deep":
            d[name] = nested(draw(st.integers(200, 3000)))
        elif kind == "huge_list":
            d[name] = [1] * draw(st.integers(300, 5000))
        elif kind == "huge_text":
            d[name] = "x" * draw(st.integers(2001, 70_000))
        else:
            d.pop(name, None)
    return d


def encodings(d: dict) -> list[object]:
    """The dict itself, as JSON text and bytes and as msgpack (where each encoder can)."""
    out: list[object] = [d]
    try:
        out.append(json.dumps(d, allow_nan=True))
        out.append(out[-1].encode())
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        out.append(msgpack.packb(d, use_bin_type=True))
    except (TypeError, ValueError, OverflowError, RecursionError):
        pass
    return out


raw_bytes = st.one_of(st.binary(max_size=300), st.builds(lambda n: b"[" * n, st.integers(1, 100_000)),
                      st.builds(lambda n: b"\x91" * n + b"\x01", st.integers(1, 100_000)))  # nested msgpack arrays


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(d=hostile_dicts(), raw=raw_bytes)
def test_parse_accepts_or_refuses_and_never_raises_anything_else(d: dict, raw: bytes) -> None:
    for line in [*encodings(d), raw, nested(5000), [d], "x" * 10]:
        try:
            parse(line, LIMITS)  # type: ignore[arg-type]
        except InvalidExperience as exc:
            assert exc.reason in REASONS


@pytest.fixture(params=["memory", "sqlite", "ray"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "ray":
        request.getfixturevalue("shared_ray")()
        # one exchange actor for all the examples (each example joins it, as with sqlite's one file):
        # the examples pay a publish, not an actor's start
        yield "ray://hostile-test"
        open_exchange("ray://hostile-test", limits=LIMITS).destroy()  # type: ignore[attr-defined]
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('ex')}/h.db"
    else:
        yield "memory://"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(bad=st.lists(hostile_dicts(), min_size=1, max_size=4), raw=raw_bytes, seed=st.integers(0, 10**9))
def test_a_batch_keeps_its_good_rows_whatever_the_bad_ones_hold(backend: str, bad: list, raw: bytes,
                                                                seed: int) -> None:
    ex = open_exchange(backend, limits=LIMITS)
    try:
        good = [honest(seed + k) for k in range(3)]
        lines: list[object] = [good[0].to_json()]
        for d in bad:
            lines.extend(encodings(d))
        lines += [raw, nested(3000), good[1].to_msgpack(), good[2].to_dict()]
        before = {r.record_id for r in ex.query(["p1"])}
        res = ex.publish_json(lines)  # never raises
        assert set(res.rejected_by_reason) <= set(REASONS)
        got = {r.record_id for r in ex.query(["p1"])} - before
        assert {g.record_id for g in good} <= got | before  # every honest row landed (or was there)
        assert all(math.isfinite(x) for r in ex.query(["p1"]) for x in r.logprobs)
    finally:
        ex.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(row=st.one_of(values, st.lists(values, min_size=4, max_size=4)), k=st.integers(0, 100))
def test_storage_form_rows_are_parsed_like_json_rows(row: object, k: int) -> None:
    """The compact wire rows a remote client sends obey the same rule and the same checks."""
    from mutualrl.experience import parse_row, to_row

    ex = open_exchange("memory://", limits=LIMITS)
    good = list(to_row(honest(k)))
    forged = [good[0], "0" * 64, good[2], good[3]]
    res = ex.publish_rows([row, good, forged, [good[0], None, good[2], good[3]]])
    assert res.accepted == 1 and res.duplicates == 1 and res.rejected_by_reason.get("bad_id") == 1
    try:
        parse_row(row, LIMITS)
    except InvalidExperience as exc:
        assert exc.reason in REASONS
