"""Speed ratios paired round by round, their intervals and verdict words, and the run's A/A pairs."""

import math

import pytest

from torchrec_het_bench.speed_intervals import (
    counted_steps,
    noise_floor,
    paired_ratio,
    rewarm_steps,
    round_rates,
)


def test_round_rates_leave_out_each_windows_rewarm():
    slow_start = [10.0] * 5 + [1.0] * 15  # each window's first 5 steps run 10x slower
    steps = slow_start * 3
    assert rewarm_steps(20) == 5
    assert round_rates(steps, 20, 100) == [100.0, 100.0, 100.0]
    assert counted_steps(steps, 20) == [1.0] * 45
    assert rewarm_steps(8) == 2  # a short window: a quarter of it


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval():
    reference = [100.0, 50.0, 80.0, 120.0]
    entry = [r * f for r, f in zip(reference, [1.5, 1.4, 1.6, 1.5])]
    got = paired_ratio(entry, reference)
    logs = [math.log(f) for f in [1.5, 1.4, 1.6, 1.5]]
    assert got.ratio == pytest.approx(math.exp(sum(logs) / 4))
    assert got.low < got.ratio < got.high
    assert got.rounds == 4 and got.word() == "faster"
    assert paired_ratio(reference, entry).word() == "slower"


def test_a_ratio_whose_interval_holds_one_is_equal_and_one_round_gives_none():
    got = paired_ratio([100.0, 103.0, 97.0], [100.0, 100.0, 100.0])
    assert got.low < 1.0 < got.high and got.word() == "equal"
    assert paired_ratio([100.0], [90.0]) is None


def test_the_machines_slow_phase_moves_both_entries_of_a_round():
    """A round where the machine ran at half speed halves both entries: the paired ratio does not move."""
    machine = [1.0, 0.5, 1.0, 0.7]
    got = paired_ratio([120.0 * m for m in machine], [100.0 * m for m in machine])
    assert got.ratio == pytest.approx(1.2) and got.high - got.low == pytest.approx(0.0, abs=1e-9)


def test_noise_floor_pairs_each_entry_with_its_twin_under_the_same_pipeline():
    def entry(name, config, rounds):
        return {"name": name, "config": config, "samples_per_s": {"rounds": rounds}}

    entries = [
        entry("stock_table_wise@sparse_dist", "stock_table_wise", [100.0, 90.0, 110.0]),
        entry("stock_table_wise_aa@sparse_dist", "stock_table_wise_aa", [101.0, 89.0, 111.0]),
        entry("planned@sparse_dist", "planned", [150.0, 140.0, 160.0]),
        {"name": "planned_aa@sparse_dist", "config": "planned_aa", "not_run": "refused"},
    ]
    (pair,) = noise_floor(entries)
    assert pair["entry"] == "stock_table_wise@sparse_dist" and pair["twin"] == "stock_table_wise_aa@sparse_dist"
    assert pair["word"] == "equal" and pair["low"] < 1.0 < pair["high"]
