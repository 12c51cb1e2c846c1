"""How many paired seeds a study needs: the power of a two-sided one-sample t test of the mean
per-seed difference (the paired comparison of :mod:`mutualrl.study.evidence`), and the smallest
number of seeds that reaches a given power.

With ``n`` seeds, per-seed differences of true mean ``delta`` and sd ``sd``, the statistic
``mean / (s / sqrt(n))`` follows a noncentral t distribution with ``n - 1`` degrees of freedom and
noncentrality ``delta / sd * sqrt(n)``. The test at level ``alpha`` rejects when ``|t|`` exceeds
the central t quantile ``t(1 - alpha/2, n - 1)``, so its power is

    P(T' > t_crit) + P(T' < -t_crit),   T' ~ noncentral t(n - 1, delta / sd * sqrt(n)).

Rejecting in the positive direction is the same event as the 95 % t interval lying above 0, so the
power is also the chance that the interval clears 0 (up to the negligible lower tail).

Both distributions are computed here without scipy (it is not a dependency of the package):

* the central t CDF by the exact finite series for integer degrees of freedom (Abramowitz and
  Stegun 26.7.3 and 26.7.4, in terms of ``theta = atan(t / sqrt(df))``), its quantile by bisection;
* the noncentral t CDF by numerical integration over the chi distribution of the denominator:
  writing ``T' = (Z + ncp) / (U / sqrt(df))`` with ``Z`` standard normal and ``U`` chi with ``df``
  degrees of freedom, ``P(T' <= t) = E_U[Phi(t U / sqrt(df) - ncp)]``, integrated with composite
  Simpson's rule on ``[max(0, sqrt(df) - 12), sqrt(df) + 12]`` (the chi distribution's sd is below
  ``1 / sqrt(2)``, so the range holds its mass to far below ``1e-12``). Checked against
  ``scipy.stats.nct`` to better than ``1e-7`` in the tests where scipy happens to be installed.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_POWER = 0.8
DEFAULT_ALPHA = 0.05
SIMPSON_INTERVALS = 800
"""Simpson intervals over the 24-unit range of the chi variable (a step of 0.03)."""


def _check_df(df: int) -> None:
    if int(df) != df or df < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df!r}")


def t_cdf(t: float, df: int) -> float:
    """The CDF of Student's t with an integer number ``df`` of degrees of freedom, exactly (the
    finite series of Abramowitz and Stegun 26.7.3/26.7.4)."""
    _check_df(df)
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if df % 2 == 1:  # A(t|df) = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 2 terms of cos
        series, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        central = 2.0 / math.pi * (theta + s * series)
    else:  # A(t|df) = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df - 2)
        series, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= c2 * (2 * k - 1) / (2 * k)
        central = s * series
    central = min(max(central, 0.0), 1.0)  # P(|T| <= |t|)
    return 0.5 + 0.5 * central if t >= 0 else 0.5 - 0.5 * central


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`,
    to ``1e-10``)."""
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _phi(x: float) -> float:
    """The standard normal CDF."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def nct_cdf(t: float, df: int, ncp: float) -> float:
    """The CDF of the noncentral t distribution with ``df`` degrees of freedom and noncentrality
    ``ncp`` at ``t``: ``E_U[Phi(t U / sqrt(df) - ncp)]`` over ``U`` chi with ``df`` degrees of
    freedom, by composite Simpson's rule (see the module's docstring)."""
    _check_df(df)
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    root = math.sqrt(df)
    a, b = max(0.0, root - 12.0), root + 12.0
    n = SIMPSON_INTERVALS
    h = (b - a) / n
    log_norm = (df / 2.0 - 1.0) * math.log(2.0) + math.lgamma(df / 2.0)

    def f(u: float) -> float:
        if u <= 0.0:
            dens = math.exp(-log_norm) if df == 1 else 0.0
        else:
            dens = math.exp((df - 1) * math.log(u) - u * u / 2.0 - log_norm)
        return dens * _phi(t * u / root - ncp) if dens > 0.0 else 0.0

    total = f(a) + f(b)
    for i in range(1, n):
        total += (4.0 if i % 2 else 2.0) * f(a + i * h)
    return min(max(total * h / 3.0, 0.0), 1.0)


def power_at(n: int, sd: float, delta: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The power of the two-sided one-sample t test at level ``alpha`` on ``n`` paired seeds when the
    per-seed differences have true mean ``delta`` and sd ``sd`` (the chance of rejecting "mean 0")."""
    if n < 2:
        raise ValueError(f"a t test needs at least 2 seeds, got {n}")
    if not sd > 0 or math.isinf(sd):
        raise ValueError(f"sd must be positive and finite, got {sd!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    df = n - 1
    crit = t_quantile(1.0 - alpha / 2.0, df)
    ncp = abs(delta) / sd * math.sqrt(n)
    upper = 1.0 - nct_cdf(crit, df, ncp)
    lower = nct_cdf(-crit, df, ncp)
    return min(max(upper + lower, 0.0), 1.0)


def seeds_for_power(sd: float, delta: float, power: float = DEFAULT_POWER, alpha: float = DEFAULT_ALPHA,
                    most: int = 200) -> int | None:
    """The smallest number ``n >= 2`` of paired seeds whose two-sided t test at level ``alpha`` has at
    least ``power`` when the true mean difference is ``delta`` and the per-seed sd is ``sd``; None
    when even ``most`` seeds fall short (a ``delta`` of 0 never gets past ``alpha``)."""
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must lie in (0, 1), got {power!r}")
    for n in range(2, most + 1):
        if power_at(n, sd, delta, alpha) >= power:
            return n
    return None


def clears_zero_above(n: int, sd: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The mean above which the ``1 - alpha`` t interval over ``n`` seeds of sample sd ``sd`` lies
    above 0: ``t(1 - alpha/2, n - 1) sd / sqrt(n)`` (1.24 sd at 5 seeds and 95 %)."""
    return t_quantile(1.0 - alpha / 2.0, n - 1) * sd / math.sqrt(n)


def plan_row(study: str, observed_sd: float, target: float, observed_mean: float | None,
             power: float = DEFAULT_POWER, alpha: float = DEFAULT_ALPHA, most: int = 200) -> dict[str, Any]:
    """One study's line of a pre-registered plan: the seeds needed for ``power`` at the ``target`` and
    at the ``observed_mean``, both with the ``observed_sd`` taken as the true per-seed sd.

    The seeds at the observed mean are None when there is no observed mean or it is not positive (the
    plan is for a positive share; a test powered for a negative one plans nothing), and None too when
    more than ``most`` seeds would be needed."""
    if not observed_sd > 0:
        raise ValueError(f"{study}: the observed sd must be positive, got {observed_sd!r}")
    at_obs = (seeds_for_power(observed_sd, observed_mean, power, alpha, most)
              if observed_mean is not None and observed_mean > 0 else None)
    return {"study": study, "observed_sd": observed_sd, "target": target, "observed_mean": observed_mean,
            "effect_size_at_target": target / observed_sd,
            "seeds_at_target": seeds_for_power(observed_sd, target, power, alpha, most),
            "seeds_at_observed_mean": at_obs,
            "power_at_5_seeds_at_target": power_at(5, observed_sd, target, alpha),
            "power": power, "alpha": alpha, "most": most,
            "method": "two-sided one-sample t test of the per-seed paired differences; power from the "
                      "noncentral t (numerical integration over the chi distribution, mutualrl.study.power)"}
