"""The link probe on gloo groups: every rank gets the same figures, within the probe's budget of
rounds and bytes; the planner probes once per group and prices what it measured."""

import pytest

from torchrec_het.planner.link_probe import KINDS
from torchrec_het_testing.link_probe_ranks import TIGHT, planner_world, probe_world
from torchrec_het_testing.spawn import spawn_world


def _within_budget(probe: dict, peers: dict[str, int]) -> None:
    for kind, count in peers.items():
        measured = probe[kind]
        assert 0 < measured["rounds"] <= TIGHT.max_rounds, (kind, measured)
        assert 0 < measured["bytes_sent"] <= TIGHT.max_bytes_per_kind(count), (kind, measured)
        assert measured["gbit"] > 0 and measured["latency_ms"] >= 0
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


def test_two_hosts_of_two_ranks_measure_every_kind_alike(tmp_path) -> None:
    ranks = spawn_world(probe_world, 4, tmp_path)
    assert all(r == ranks[0] for r in ranks)
    figures = ranks[0]
    assert figures["intra_source"] == figures["inter_source"] == "measured"
    assert set(figures["probe"]) - {"seconds", "rounds", "bytes_sent"} == set(KINDS)
    _within_budget(figures["probe"], {"intra": 1, "inter": 2, "inter_one_way": 1})
