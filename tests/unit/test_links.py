"""Link figures: the probe's arithmetic and escalation (on a modelled link, no process group),
the settings that state figures or turn the probe off, and where each figure the planner
prices with comes from. The probe on a real gloo group: tests/distributed/test_link_probe.py."""

import logging

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH

import torchrec_het
from torchrec_het import _compat
from torchrec_het.integration import registration
from torchrec_het.integration.env_settings import check_environment, env_settings
from torchrec_het.planner import HetEmbeddingEnumerator, HetEmbeddingShardingPlanner
from torchrec_het.planner.link_probe import (
    FLOAT,
    KINDS,
    TINY_ROUNDS,
    LinkMeasurement,
    ProbeBudget,
    ProbeResult,
    fit_link,
    measure_kind,
    pattern,
)
from torchrec_het.planner.network import (
    CPU_INTER_HOST_BW,
    CPU_INTRA_HOST_BW,
    GBIT,
    HetCommsBandwidths,
    LinkSettings,
    kinds_to_probe,
    link_figures,
    parse_link_gbit,
    parse_switch,
    with_links,
)
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het_testing.modelled_rounds import ModelledRounds

# --- the probe's arithmetic -------------------------------------------------------------------


def test_fit_removes_the_latency_of_two_sizes() -> None:
    bytes_per_ms, latency_ms = 156_250.0, 0.3  # 1.25 Gbit/s, 0.3 ms a round
    times = {n: latency_ms / 1e3 + n / (bytes_per_ms * 1e3) for n in (8, 8 << 20)}
    fitted = fit_link(8, times[8], 8 << 20, times[8 << 20])
    assert fitted == pytest.approx((bytes_per_ms, latency_ms, True))


def test_fit_of_a_large_round_no_slower_than_a_small_one_is_a_lower_bound() -> None:
    assert fit_link(8, 0.010, 1 << 20, 0.005) == pytest.approx(((1 << 20) / 5.0, 0.0, False))
    assert fit_link(8, 0.001, 1 << 20, 0.0005)[1] == 0.0  # never a negative latency
    with pytest.raises(ValueError, match="large_bytes > small_bytes"):
        fit_link(8, 0.1, 8, 0.2)


def test_patterns_pair_every_send_with_a_receive() -> None:
    world, local = 6, 2  # 3 hosts of 2
    for kind in KINDS:
        parts = [pattern(rank, world, local, kind) for rank in range(world)]
        sends = {(r, p) for r, part in enumerate(parts) for p in part.send_to}
        receives = {(p, r) for r, part in enumerate(parts) for p in part.receive_from}
        assert sends == receives, kind
        assert all(len(part.send_to) in (0, part.fanout) for part in parts), kind
    assert pattern(0, world, local, "intra").send_to == (1,)
    assert pattern(0, world, local, "inter").send_to == (2, 3, 4, 5)
    one_way = [pattern(r, world, local, "inter_one_way") for r in range(world)]
    assert [p.send_to for p in one_way] == [(2,), (3,), (), (), (), ()]  # host 0 -> host 1; host 2 idles
    assert [p.receive_from for p in one_way] == [(), (), (0,), (1,), (), ()]
    assert pattern(0, 2, 2, "inter").fanout == 0 and pattern(0, 2, 1, "intra").fanout == 0  # nothing to measure
    with pytest.raises(ValueError, match="link kind"):
        pattern(0, 2, 1, "between")


@pytest.mark.parametrize("gbit", [0.1, 1.25, 10.0, 400.0])
def test_escalation_finds_the_rate_within_the_budget(gbit: float) -> None:
    budget = ProbeBudget()
    rounds = ModelledRounds(gbit * GBIT, latency_ms=0.3)
    measured = measure_kind(rounds, budget)
    assert measured.bytes_per_ms == pytest.approx(gbit * GBIT, rel=1e-6)
    assert measured.latency_ms == pytest.approx(0.3, rel=1e-6) and measured.fitted
    assert measured.rounds == rounds.rounds <= budget.max_rounds
    assert measured.bytes_sent == rounds.bytes_sent <= budget.max_bytes_per_kind()
    assert max(rounds.sizes) <= budget.max_bytes
    assert rounds.spent_s < budget.seconds


def test_a_noisy_round_does_not_stop_the_escalation_and_the_fastest_counts() -> None:
    gbit = 1.25
    quiet = ModelledRounds(gbit * GBIT, 0.3)
    measure_kind(quiet, ProbeBudget())
    noisy = ModelledRounds(gbit * GBIT, 0.3, slow_rounds={1 + TINY_ROUNDS + 2, 1 + TINY_ROUNDS + 5}, slowdown=40)
    measured = measure_kind(noisy, ProbeBudget())
    assert max(noisy.sizes) == max(quiet.sizes)  # the slow round was confirmed, found fast, and escalation went on
    assert measured.bytes_per_ms == pytest.approx(gbit * GBIT, rel=1e-6)


def test_a_short_budget_ends_the_probe_early_with_a_figure() -> None:
    generous = ModelledRounds(0.1 * GBIT, 0.3)
    measure_kind(generous, ProbeBudget())
    rounds = ModelledRounds(0.1 * GBIT, 0.3, deadline_s=0.05)
    measured = measure_kind(rounds, ProbeBudget(seconds=0.05))
    assert rounds.spent_s <= 0.05 and measured.rounds < generous.rounds and max(rounds.sizes) < max(generous.sizes)
    assert measured.bytes_per_ms == pytest.approx(0.1 * GBIT, rel=1e-6)


def test_budget_bounds_and_validation() -> None:
    budget = ProbeBudget(first_bytes=1 << 16, max_bytes=1 << 20, repeats=2)
    assert budget.escalation_sizes == 5  # 64 KiB ... 1 MiB
    assert budget.max_rounds == 1 + TINY_ROUNDS + 10 + 2 * 2  # the repeats, and as many to re-measure
    assert budget.max_bytes_per_kind(peers=3) == FLOAT * 3 * (1 + TINY_ROUNDS) + (4 + 2 * 2) * (1 << 20)
    for bad in ({"seconds": 0}, {"first_bytes": 0}, {"first_bytes": 2, "max_bytes": 1}, {"repeats": -1}):
        with pytest.raises(ValueError, match="ProbeBudget"):
            ProbeBudget(**bad)


# --- settings -----------------------------------------------------------------------------------


def test_link_gbit_text_states_either_figure_or_both() -> None:
    assert parse_link_gbit("16,1.25", "X") == (16.0, 1.25)
    assert parse_link_gbit(" ,1.25", "X") == (None, 1.25)
    assert parse_link_gbit("8, ", "X") == (8.0, None)
    for bad in ("1.25", ",", "a,1", "0,1", "1,-2", "1,inf", "1,2,3", ""):
        with pytest.raises(ValueError, match="TORCHREC_HET_LINK_GBIT"):
            parse_link_gbit(bad, "TORCHREC_HET_LINK_GBIT")


def test_switch_text() -> None:
    assert [parse_switch(t, "X") for t in ("1", "on", "TRUE", "yes", "0", "Off", "false", "no")] == [True] * 4 + [
        False
    ] * 4
    with pytest.raises(ValueError, match="TORCHREC_HET_LINK_PROBE"):
        parse_switch("maybe", "TORCHREC_HET_LINK_PROBE")


def test_link_settings_validate() -> None:
    for bad in ({"intra_gbit": 0}, {"inter_gbit": "1"}, {"inter_gbit": True}, {"intra_gbit": float("nan")}):
        with pytest.raises(ValueError, match="must be a number of Gbit/s"):
            LinkSettings(**bad)
    with pytest.raises(ValueError, match="link_probe"):
        LinkSettings(probe="no")


@pytest.mark.parametrize("name,value", [("TORCHREC_HET_LINK_GBIT", "fast"), ("TORCHREC_HET_LINK_GBIT", "1"),
                                        ("TORCHREC_HET_LINK_PROBE", "2")])  # fmt: skip
def test_a_bad_link_setting_names_its_variable_before_anything_starts(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        check_environment()  # what the launcher runs before torchrun
    with pytest.raises(ValueError, match=name):
        torchrec_het.install()
    assert not registration.installed()


def test_install_takes_link_settings_from_arguments_or_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TORCHREC_HET_LINK_GBIT", ",1.25")
    monkeypatch.setenv("TORCHREC_HET_LINK_PROBE", "0")
    assert (env_settings()["link_gbit"], env_settings()["link_probe"]) == ((None, 1.25), False)
    try:
        torchrec_het.install()
        assert HetEmbeddingShardingPlanner.installed_links == LinkSettings(None, 1.25, False, "$TORCHREC_HET_LINK_GBIT")
        torchrec_het.install(link_gbit="4,", link_probe=True)
        assert HetEmbeddingShardingPlanner.installed_links == LinkSettings(4.0, None, True, "install(link_gbit=...)")
        planner = HetEmbeddingShardingPlanner(topology=_topology(4, 2), link_gbit=(None, 2.0))  # its own arguments win
        assert planner.link_settings == LinkSettings(None, 2.0, True, "link_gbit")
        with pytest.raises(ValueError, match="install\\(link_gbit=...\\)"):
            torchrec_het.install(link_gbit=(1.0,))
    finally:
        torchrec_het.uninstall()
    assert HetEmbeddingShardingPlanner.installed_links is None


# --- where each figure comes from ---------------------------------------------------------------


def _topology(world_size: int, local_world_size: int, device: str = "cpu", **bandwidths) -> Topology:
    return Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device, **bandwidths)


def _probe(intra_gbit: float | None, inter_gbit: float | None) -> ProbeResult:
    def measured(gbit):
        return None if gbit is None else LinkMeasurement(gbit * GBIT, 0.25, 12, 1 << 24)

    return ProbeResult(
        measured(intra_gbit), measured(inter_gbit), measured(inter_gbit and 2 * inter_gbit), 0.8, ProbeBudget()
    )


def test_stated_figures_come_first_then_measured_then_assumed() -> None:
    topology = _topology(4, 2)
    figures = link_figures(topology, LinkSettings(inter_gbit=1.25, origin="$TORCHREC_HET_LINK_GBIT"), _probe(20.0, 0.6))
    assert (figures.intra_host_bw, figures.intra_source) == (pytest.approx(20 * GBIT), "measured")
    assert (figures.inter_host_bw, figures.inter_source, figures.inter_note) == (
        1.25 * GBIT,
        "stated",
        "$TORCHREC_HET_LINK_GBIT",
    )
    assumed = link_figures(topology, LinkSettings(), None, unmeasured="probe off")
    assert (assumed.intra_host_bw, assumed.inter_host_bw) == (CPU_INTRA_HOST_BW, CPU_INTER_HOST_BW)
    assert (
        assumed.intra_source == assumed.inter_source == "assumed" and assumed.inter_note == "gloo over TCP; probe off"
    )
    gpu = link_figures(_topology(4, 2, "cuda"), LinkSettings(), None)
    assert (gpu.intra_host_bw, gpu.inter_host_bw) == (INTRA_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH)
    one_host = link_figures(_topology(2, 2), LinkSettings(), _probe(20.0, None))
    assert one_host.inter_source == "assumed" and one_host.inter_note.endswith("one host")
    own = link_figures(
        _topology(4, 2, intra_host_bw=9e5, inter_host_bw=1e5), LinkSettings(inter_gbit=2.0), _probe(20.0, 0.6)
    )
    assert (own.intra_host_bw, own.intra_source, own.inter_source) == (9e5, "stated", "stated")  # the Topology's own
    assert own.inter_host_bw == 2 * GBIT


def test_the_probe_measures_only_what_the_topology_has_and_nothing_states() -> None:
    assert kinds_to_probe(_topology(4, 2), LinkSettings()) == ["intra", "inter"]
    assert kinds_to_probe(_topology(2, 2), LinkSettings()) == ["intra"]
    assert kinds_to_probe(_topology(2, 1), LinkSettings()) == ["inter"]
    assert kinds_to_probe(_topology(4, 2), LinkSettings(intra_gbit=8.0)) == ["inter"]
    assert kinds_to_probe(_topology(4, 2), LinkSettings(probe=False)) == []
    assert kinds_to_probe(_topology(4, 2, intra_host_bw=9e5), LinkSettings()) == []  # the caller's own figures


def test_the_priced_topology_carries_the_figures_and_leaves_the_callers_alone() -> None:
    topology = _topology(4, 2)
    figures = link_figures(topology, LinkSettings(), _probe(20.0, 0.6))
    priced = with_links(topology, figures, LinkSettings())
    assert isinstance(priced.comms_bandwidths, HetCommsBandwidths) and priced.comms_bandwidths.figures is figures
    assert (priced.intra_host_bw, priced.inter_host_bw) == (figures.intra_host_bw, figures.inter_host_bw)
    assert topology.intra_host_bw == INTRA_NODE_BANDWIDTH
    own = _topology(4, 2, intra_host_bw=9e5)
    assert with_links(own, link_figures(own, LinkSettings(), None), LinkSettings()) is own


def test_figures_describe_themselves_in_one_line_and_as_a_record() -> None:
    figures = link_figures(_topology(4, 2), LinkSettings(inter_gbit=1.25, origin="X"), _probe(20.0, None))
    line = figures.describe()
    assert "within a host 20 Gbit/s (measured: probe, 12 rounds, latency 0.25 ms removed)" in line
    assert "between hosts 1.25 Gbit/s (stated: X)" in line and "probe 0.80 s, 12 rounds" in line
    record = figures.as_dict()
    assert record["intra_gbit"] == pytest.approx(20.0) and record["inter_source"] == "stated"
    assert record["probe"]["intra"]["rounds"] == 12 and "inter" not in record["probe"]


# --- the planner --------------------------------------------------------------------------------


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=16, num_embeddings=1000)
        for i in range(2)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def test_the_planner_prices_and_prints_the_figures_it_has(caplog) -> None:
    caplog.set_level(logging.INFO)
    planner = HetEmbeddingShardingPlanner(topology=_topology(4, 2), batch_size=64, link_gbit=(16.0, None))
    assert planner.links.intra_source == "stated" and planner.links.inter_source == "assumed"
    assert "plan() has no process group" in planner.links.inter_note
    priced = _compat.planner_settings(planner)[0]
    assert (priced.intra_host_bw, priced.inter_host_bw) == (16 * GBIT, CPU_INTER_HOST_BW)
    planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    assert (
        "torchrec_het links (per rank, all ranks sending at once): within a host 16 Gbit/s (stated: link_gbit)"
        in caplog.text
    )
    off = HetEmbeddingShardingPlanner(topology=_topology(4, 2), link_probe=False)
    assert off.links.intra_note == "gloo over TCP; probe off"
    own = HetEmbeddingShardingPlanner(topology=_topology(4, 2), enumerator=HetEmbeddingEnumerator(_topology(4, 2)))
    assert "the enumerator given prices with its own topology" in own.links.inter_note
