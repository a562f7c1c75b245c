"""The link probe on gloo groups: every rank gets the same figures, within the probe's budget of
rounds and bytes; the planner probes once per group and prices what it measured; a low
``enough_bytes_per_ms`` cuts what it sends, and a dispersed series is reported not steady."""

import pytest

from torchrec_het.planner.link_probe import KINDS, TINY_ROUNDS
from torchrec_het_testing.link_probe_ranks import TIGHT, budgets_world, planner_world, probe_world
from torchrec_het_testing.spawn import spawn_world


def _within_budget(probe: dict, peers: dict[str, int]) -> None:
    for kind, count in peers.items():
        measured = probe[kind]
        assert 0 < measured["rounds"] <= TIGHT.max_rounds, (kind, measured)
        assert 0 < measured["bytes_sent"] <= TIGHT.max_bytes_per_kind(count), (kind, measured)
        assert measured["gbit"] > 0 and measured["latency_ms"] >= 0
        assert not measured["enough"] and measured["steady"] == (measured["why"] == "")
    assert probe["rounds"] <= len(peers) * TIGHT.max_rounds


def test_collective_plan_measures_between_hosts_once_and_every_rank_agrees(tmp_path) -> None:
    ranks = spawn_world(planner_world, 2, tmp_path)
    assert ranks[0] == ranks[1]  # the same figures, bit for bit, on every rank
    planner = ranks[0]["planner"]
    assert planner["inter_source"] == "measured" and planner["inter_note"].startswith("probe, ")
    assert planner["intra_source"] == "assumed" and planner["intra_note"] == "gloo over TCP; one rank per host"
    assert planner["inter_gbit"] == pytest.approx(planner["probe"]["inter"]["gbit"])
    assert set(planner["probe"]) - {"seconds", "rounds", "bytes_sent"} == {"inter"}  # what it prices, no more
    _within_budget(planner["probe"], {"inter": 1})
    assert ranks[0]["probed_once"] and ranks[0]["tables"] == ["t0", "t1"]
    unprobed = ranks[0]["without_evidence"]  # no table may take a plugin type: no choice depends on the link
    assert "probe" not in unprobed and unprobed["inter_source"] == "assumed"
    assert "no table may take a plugin type" in unprobed["inter_note"]


def test_two_hosts_of_two_ranks_measure_every_kind_alike(tmp_path) -> None:
    ranks = spawn_world(probe_world, 4, tmp_path)
    assert all(r == ranks[0] for r in ranks)
    figures = ranks[0]
    assert figures["intra_source"] == figures["inter_source"] == "measured"
    assert set(figures["probe"]) - {"seconds", "rounds", "bytes_sent"} == set(KINDS)
    _within_budget(figures["probe"], {"intra": 1, "inter": 2, "inter_one_way": 1})


def test_enough_stops_early_and_a_dispersed_series_is_not_steady(tmp_path) -> None:
    ranks = spawn_world(budgets_world, 2, tmp_path)
    assert ranks[0] == ranks[1]  # the same figures and flags on every rank, though only rank 1 was slow
    plain, enough, dispersed = (ranks[0][name]["probe"]["inter"] for name in ("plain", "enough", "dispersed"))
    # enough: the first escalating round (4 KiB) was already faster than 100 bytes/ms: a lower bound, no more rounds
    assert enough["enough"] and enough["steady"] and not plain["enough"]
    assert enough["rounds"] < plain["rounds"] and 20 * enough["bytes_sent"] < plain["bytes_sent"], (enough, plain)
    assert enough["bytes_sent"] <= TIGHT.first_bytes + 64 and enough["gbit"] * 1e9 / 8e3 >= 100.0
    assert "enough" in ranks[0]["enough"]["inter_note"]
    # every other round of the final size 30 ms late on rank 1: re-measured, still spread, not steady
    assert not dispersed["steady"] and "spread" in dispersed["why"] and "re-measured" in dispersed["why"]
    assert not ranks[0]["dispersed"]["steady"] and ranks[0]["dispersed"]["why"].startswith("inter: ")
    assert "not steady" in ranks[0]["dispersed"]["describe"]
    assert dispersed["rounds"] >= 1 + TINY_ROUNDS + TIGHT.escalation_sizes + 2 * TIGHT.repeats  # the re-measure ran
    _within_budget({"inter": dispersed, "rounds": dispersed["rounds"]}, {"inter": 1})
