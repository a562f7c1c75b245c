"""The link probe's decisions without a process group: medians, the dispersion rule and its
re-measure, the ``enough`` rule, on a modelled link whose rounds can be scripted to misbehave.
The probe's fit, patterns and escalation: tests/unit/test_links.py; on gloo:
tests/distributed/test_link_probe.py."""

import pytest

from torchrec_het.planner.link_probe import (
    TINY_ROUNDS,
    LinkMeasurement,
    ProbeBudget,
    ProbeResult,
    is_enough,
    measure_kind,
    settle,
    spread,
    unsteady,
)
from torchrec_het.planner.network import GBIT, LinkSettings, link_figures
from torchrec_het_testing.modelled_rounds import ModelledRounds

# --- the pure rules -----------------------------------------------------------------------------


def test_spread_and_the_dispersion_rule() -> None:
    assert spread([0.02, 0.01, 0.015]) == pytest.approx(2.0)
    assert spread([0.0, 0.01]) == float("inf")
    assert unsteady([0.010, 0.014, 0.012], 1.5) == ""
    assert unsteady([0.010, 0.015], 1.5) == ""  # at the limit: steady
    assert "spread 1.60x (> 1.5x)" in unsteady([0.010, 0.016, 0.011], 1.5)
    assert "nothing to compare" in unsteady([0.010], 1.5)  # one round says nothing about its spread


def test_settle_takes_medians_and_re_measures_a_dispersed_series() -> None:
    assert settle([0.010, 0.030, 0.011, 0.012], None, 4.0) == (pytest.approx(0.0115), True, "")  # the median
    assert settle([0.010, 0.011, 0.008], [0.5], 1.5) == (0.010, True, "")  # steady: a re-measure is not looked at
    seconds, steady, why = settle([0.010, 0.030, 0.011], [], 1.5)
    assert (seconds, steady) == (0.011, False) and why.endswith("no time to re-measure")
    assert settle([0.010, 0.030, 0.011], [0.020, 0.021], 1.5) == (0.0205, True, "")  # the re-measure replaces them
    seconds, steady, why = settle([0.010, 0.030, 0.011], [0.020, 0.040], 1.5)
    assert (seconds, steady) == (pytest.approx(0.020), False)  # the median of all five
    assert "spread 3.00x" in why and "re-measured, 2 rounds of the final size spread 2.00x" in why


def test_enough_is_a_round_whose_rate_latency_included_reaches_the_threshold() -> None:
    assert is_enough(1000, 0.001, 1000.0)  # 1000 bytes in 1 ms: 1000 bytes per ms
    assert not is_enough(999, 0.001, 1000.0)
    assert not is_enough(1 << 30, 1e-9, None)  # no threshold: never enough


def test_budget_validates_the_new_fields_and_its_bounds_count_the_re_measure() -> None:
    for bad in ({"max_spread": 0.9}, {"enough_bytes_per_ms": 0.0}, {"enough_bytes_per_ms": -1.0}):
        with pytest.raises(ValueError, match="ProbeBudget"):
            ProbeBudget(**bad)
    budget = ProbeBudget(first_bytes=1 << 16, max_bytes=1 << 20, repeats=3)
    assert budget.max_rounds == 1 + TINY_ROUNDS + 2 * 5 + 2 * 3
    assert budget.max_bytes_per_kind() == 4 * (1 + TINY_ROUNDS) + (4 + 2 * 3) * (1 << 20)


# --- measure_kind on a modelled link ------------------------------------------------------------


def _final_size(bytes_per_ms: float, budget: ProbeBudget) -> int:
    quiet = ModelledRounds(bytes_per_ms)
    measure_kind(quiet, budget)
    return max(quiet.sizes)


def test_medians_not_minima_make_the_figure_and_the_latency() -> None:
    rate, budget = 1.25 * GBIT, ProbeBudget()
    final = _final_size(rate, budget)

    def noise(nbytes, nth):  # a tiny round 10x slow, one 0.7x (a timer's glitch); one large round 0.8x, one 1.15x
        if nbytes == 4:
            return {2: 10.0, 3: 0.7}.get(nth - 1, 1.0)  # nth 0 is the warm-up
        return {3: 0.8, 5: 1.15}.get(nth, 1.0) if nbytes == final else 1.0

    rounds = ModelledRounds(rate, noise=noise)
    measured = measure_kind(rounds, budget)
    assert measured.steady and measured.why == "" and measured.fitted and not measured.enough
    assert measured.bytes_per_ms == pytest.approx(rate, rel=1e-9)  # the minima would read 1/0.8 of it
    assert measured.latency_ms == pytest.approx(0.3, rel=1e-6)
    assert rounds.sizes.count(final) == 2 + budget.repeats  # steady: no re-measure


def test_a_dispersed_series_is_re_measured_and_a_steady_re_measure_counts() -> None:
    rate, budget = 1.25 * GBIT, ProbeBudget()
    final = _final_size(rate, budget)
    once = ModelledRounds(rate, noise=lambda nbytes, nth: 2.0 if nbytes == final and nth == 3 else 1.0)
    measured = measure_kind(once, budget)
    assert measured.steady and measured.bytes_per_ms == pytest.approx(rate, rel=1e-9)
    assert measured.bounds == pytest.approx((rate, rate), rel=1e-9)  # the re-measure's rounds only
    assert once.sizes.count(final) == 2 + 2 * budget.repeats  # the repeats, and the re-measure


def test_a_series_that_stays_dispersed_is_not_steady() -> None:
    rate, budget = 1.25 * GBIT, ProbeBudget()
    final = _final_size(rate, budget)
    rounds = ModelledRounds(rate, noise=lambda nbytes, nth: 2.0 if nbytes == final and nth >= 2 and nth % 2 else 1.0)
    measured = measure_kind(rounds, budget)
    assert not measured.steady and "re-measured" in measured.why and "spread 2.00x" in measured.why
    low, high = measured.bounds  # every round of the final size: the slow ones and the fast ones
    assert low < measured.bytes_per_ms <= high and high == pytest.approx(rate, rel=1e-9) and high / low > 1.9
    assert rounds.sizes.count(final) == 2 + 2 * budget.repeats
    assert measured.rounds == rounds.rounds <= budget.max_rounds
    assert measured.bytes_sent <= budget.max_bytes_per_kind()
    result = ProbeResult(None, measured, None, 1.0, budget)
    assert not result.steady and result.why.startswith("inter: ")
    figures = link_figures_for(result)
    assert "not steady" in figures.inter_note and "(not steady)" in figures.describe()
    assert figures.as_dict()["probe"]["inter"]["steady"] is False


def test_a_short_budget_with_no_repeats_is_not_steady() -> None:
    rounds = ModelledRounds(0.1 * GBIT, deadline_s=0.05)  # the first large round takes 32 ms of the 50
    measured = measure_kind(rounds, ProbeBudget(seconds=0.05, first_bytes=400_000, max_bytes=1 << 20))
    assert rounds.sizes.count(400_000) == 1 and rounds.spent_s <= 0.05
    assert measured.bytes_per_ms == pytest.approx(0.1 * GBIT, rel=1e-6)  # still a figure
    assert not measured.steady and "no time to re-measure" in measured.why


def test_enough_stops_the_escalation_at_a_fast_enough_round() -> None:
    budget = ProbeBudget()
    fast = 400 * GBIT
    full = ModelledRounds(fast)
    measured_full = measure_kind(full, budget)
    assert not measured_full.enough and measured_full.bytes_per_ms == pytest.approx(fast, rel=1e-6)

    threshold = 10 * GBIT
    enough = ModelledRounds(fast)
    measured = measure_kind(enough, ProbeBudget(enough_bytes_per_ms=threshold))
    assert measured.enough and measured.steady and not measured.fitted
    assert threshold <= measured.bytes_per_ms < fast  # a lower bound: the round's latency is in it
    assert 100 * measured.bytes_sent < measured_full.bytes_sent and measured.rounds < measured_full.rounds
    # the first size whose rate (latency included) reaches the threshold, no larger
    rates = [s / (0.3 + s / fast) for s in enough.sizes[1 + TINY_ROUNDS :]]
    assert rates[-1] >= threshold and all(r < threshold for r in rates[:-1]) and len(rates) > 1
    assert measured.latency_ms == pytest.approx(0.3 + 4 / fast)  # the tiny rounds' median
    figures = link_figures_for(ProbeResult(None, measured, None, 0.1, budget))
    assert "enough: a lower bound" in figures.inter_note and figures.as_dict()["probe"]["inter"]["enough"]


def test_enough_above_the_link_changes_nothing() -> None:
    slow = 0.1 * GBIT
    plain, with_threshold = ModelledRounds(slow), ModelledRounds(slow)
    assert measure_kind(plain, ProbeBudget()) == measure_kind(with_threshold, ProbeBudget(enough_bytes_per_ms=GBIT))
    assert plain.sizes == with_threshold.sizes


def link_figures_for(result: ProbeResult):
    from torchrec.distributed.planner import Topology

    return link_figures(Topology(world_size=2, local_world_size=1, compute_device="cpu"), LinkSettings(), result)


def test_measurement_defaults_keep_old_constructions() -> None:
    m = LinkMeasurement(GBIT, 0.1, 10, 1 << 20)
    assert m.steady and m.why == "" and not m.enough and m.fitted
