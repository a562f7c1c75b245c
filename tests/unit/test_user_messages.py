"""What a user prints: the plugin's counters and the hybrid pipeline's staleness gauge, labelled."""

import torch

import torchrec_het
from torchrec_het.pipeline.hybrid import StalenessGauge
from torchrec_het.sharding.common.cache_stats import GroupStats


def _cache(**counts: int) -> dict:
    stats = GroupStats(num_tables=1, dim=4)
    for name, count in counts.items():
        stats.add_per_table(name, torch.tensor([count]))
    return stats.table(0)


def test_a_cache_that_looked_nothing_up_shows_no_hit_rate_of_0_percent() -> None:
    lines = torchrec_het.describe_stats({"t_item": {"sharding_type": "het_cached_row_wise", "cache": _cache()}})
    assert lines == ["t_item: het_cached_row_wise cache: no lookups on this rank yet, so no hit rate"]
    local = {"t_item": {"cache": _cache(lookups=40, unique_lookups=12)}}  # every row it read is this rank's
    assert torchrec_het.describe_stats(local) == [
        "t_item: het_cached_row_wise cache: 40 lookups, none of another rank's rows, so no hit rate"
    ]


def test_a_cache_that_looked_rows_up_shows_its_hit_rate_and_what_it_counts() -> None:
    counts = dict(lookups=100, remote_lookups=80, hits_lookups=60, remote_unique=30, hits_unique=12, rows_fetched=18,
                  rows_pushed=25)  # fmt: skip
    (line,) = torchrec_het.describe_stats({"t_item": {"cache": _cache(**counts)}})
    assert line == (
        "t_item: het_cached_row_wise cache: hit rate 75% of 80 lookups of other ranks' rows (12 of 30 distinct "
        "rows); 18 rows fetched, 25 pushed"
    )


def test_replica_counters_are_labelled() -> None:
    replication = {"steps": 20, "skipped_steps": 3, "sparse_syncs": 20, "dense_syncs": 0, "host_syncs": 0}
    assert torchrec_het.describe_stats({"t_user": {"replication": replication}}) == [
        "t_user: het_row_replicated: 20 steps (3 all hot, no cold exchange); replica syncs: 20 sparse (the rows "
        "read since the last one), 0 dense (every hot row: most were read)"
    ]


def test_the_staleness_gauge_prints_labelled_with_its_unit() -> None:
    gauge = StalenessGauge()
    assert str(gauge) == "staleness: no batch trained yet"
    for missed in (0, 1, *[2] * 18):
        gauge.record(missed)
    assert str(gauge) == (
        "staleness over 20 batches: a read missed at most 2 embedding updates, 1.85 on average "
        "(batches: 1 missed 0, 1 missed 1, 18 missed 2)"
    )
    assert f"{gauge}" == str(gauge)  # an f-string shows the same
