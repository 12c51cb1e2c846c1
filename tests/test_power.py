"""The seeds a study needs for its power: textbook values, monotonicity, the edges, and (where scipy
happens to be installed) agreement with scipy's distributions."""

import itertools
import math

import pytest

from mutualrl.study import power as P
from mutualrl.study.evidence import T_975


def test_textbook_one_sample_t_test_d_1_needs_10_seeds():
    # Cohen's d = 1, two-sided alpha .05, power .8: n = 10 (power 0.803; 9 seeds give 0.748)
    assert P.seeds_for_power(1.0, 1.0) == 10
    assert P.power_at(10, 1.0, 1.0) == pytest.approx(0.8031, abs=5e-4)
    assert P.power_at(9, 1.0, 1.0) < 0.8 <= P.power_at(10, 1.0, 1.0)
    # d = 0.5 needs 34 (the standard table value), and only the ratio delta / sd matters
    assert P.seeds_for_power(1.0, 0.5) == 34
    assert P.seeds_for_power(4.0, 2.0) == 34


def test_seeds_fall_as_the_effect_grows():
    ns = [P.seeds_for_power(3.0, d) for d in (1.0, 1.5, 2.0, 3.0, 5.0, 8.0)]
    assert all(n is not None for n in ns)
    assert ns == sorted(ns, reverse=True) and ns[0] > ns[-1]
    # and rise with the spread
    assert P.seeds_for_power(2.0, 3.0) < P.seeds_for_power(4.0, 3.0)


def test_power_rises_with_seeds_and_starts_above_alpha():
    powers = [P.power_at(n, 2.0, 1.5) for n in range(2, 40)]
    assert all(b > a for a, b in itertools.pairwise(powers))
    assert powers[0] > 0.05 and powers[-1] < 1.0
    # no effect: the power is the level, whatever the seeds
    assert P.power_at(7, 1.0, 0.0) == pytest.approx(0.05, abs=1e-6)
    # the sign of the effect does not matter to a two-sided test
    assert P.power_at(6, 1.0, -1.2) == pytest.approx(P.power_at(6, 1.0, 1.2), abs=1e-9)


def test_none_beyond_most_and_for_no_effect():
    assert P.seeds_for_power(1.0, 0.1, most=200) is None  # needs ~787
    assert P.seeds_for_power(1.0, 0.0) is None
    assert P.seeds_for_power(1.0, 1.0, most=9) is None
    assert P.seeds_for_power(1.0, 1.0, most=10) == 10


def test_smallest_n_is_2_for_a_huge_effect():
    assert P.seeds_for_power(0.01, 10.0) == 2


def test_central_t_matches_the_table_the_intervals_use():
    for df, q in T_975.items():
        assert P.t_quantile(0.975, df) == pytest.approx(q, abs=1e-3)
        assert P.t_cdf(q, df) == pytest.approx(0.975, abs=1e-4)
    assert P.t_cdf(0.0, 5) == 0.5
    assert P.t_cdf(1.3, 4) + P.t_cdf(-1.3, 4) == pytest.approx(1.0)


def test_noncentral_t_with_zero_noncentrality_is_central_t():
    for df in (1, 2, 3, 8, 31):
        for t in (-2.5, -0.3, 0.0, 1.1, 3.7):
            assert P.nct_cdf(t, df, 0.0) == pytest.approx(P.t_cdf(t, df), abs=1e-7)  # Simpson's error, ~1e-8


def test_clears_zero_at_five_seeds_above_1_24_sd():
    assert P.clears_zero_above(5, 1.0) == pytest.approx(2.776 / math.sqrt(5), abs=1e-3)
    assert round(P.clears_zero_above(5, 1.0), 2) == 1.24


def test_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 19, 60, 150):
        assert P.t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-8)
        for t in (-3.0, -0.5, 0.7, 2.2, 5.0):
            assert P.t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-10)
            for ncp in (0.5, 2.0, 4.5, 9.0):
                want = float(stats.nct.cdf(t, df, ncp))
                if math.isnan(want):  # scipy gives up far in the lower tail (e.g. t = -3, ncp = 9)
                    assert P.nct_cdf(t, df, ncp) < 1e-12
                    continue
                assert P.nct_cdf(t, df, ncp) == pytest.approx(want, abs=1e-7)


def test_plan_row():
    row = P.plan_row("mix", observed_sd=3.6, target=3.0, observed_mean=4.2)
    assert row["study"] == "mix" and row["target"] == 3.0
    assert row["seeds_at_target"] == P.seeds_for_power(3.6, 3.0)
    assert row["seeds_at_observed_mean"] == P.seeds_for_power(3.6, 4.2)
    assert row["seeds_at_observed_mean"] < row["seeds_at_target"]
    assert row["effect_size_at_target"] == pytest.approx(3.0 / 3.6)
    assert 0.05 < row["power_at_5_seeds_at_target"] < 0.8
    assert P.plan_row("x", 2.0, 5.0, None)["seeds_at_observed_mean"] is None
    assert P.plan_row("x", 2.0, 5.0, -1.0)["seeds_at_observed_mean"] is None
    with pytest.raises(ValueError):
        P.plan_row("x", 0.0, 5.0, 1.0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        P.power_at(1, 1.0, 1.0)
    with pytest.raises(ValueError):
        P.power_at(5, -1.0, 1.0)
    with pytest.raises(ValueError):
        P.seeds_for_power(1.0, 1.0, power=1.0)
    with pytest.raises(ValueError):
        P.t_quantile(1.5, 3)
