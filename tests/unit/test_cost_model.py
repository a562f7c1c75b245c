"""The planner's one cost model: options priced by the step model, and the rule that keeps TorchRec's
plan unless the plugin's is predicted faster by more than the model's error."""

import logging

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology

from torchrec_het.integration.plan_check import prediction_of
from torchrec_het.planner import AccessModel, HetEmbeddingEnumerator, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.planner.access import zipf_shares
from torchrec_het.planner.cost_model import CostInputs, decide
from torchrec_het.planner.step_model import Compute, Links, PhaseBytes, StepPrediction
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder

SIZES = {"a": 100_000, "b": 50_000}
BATCH = 512
COMPUTE = Compute(lookup_s_per_id=2e-7, dense_s_per_sample=2e-5)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=128, num_embeddings=r)
        for n, r in SIZES.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _pricing() -> PluginPricing:
    counts = tuple((zipf_shares(r, 1.1) * BATCH * 4).floor().long() for r in SIZES.values())
    return PluginPricing(AccessModel(AccessProfile(tuple(SIZES), tuple(SIZES.values()), counts, 4)))


def _step(total_ms: float) -> StepPrediction:
    return StepPrediction(PhaseBytes(), 0.0, 0.0, total_ms / 1e3, 0.0, "sparse_dist")


INPUTS = CostInputs(Links(1e9, 1e9), COMPUTE)


def test_the_plugins_plan_is_kept_only_where_it_beats_torchrecs_by_more_than_the_margin() -> None:
    assert decide(_step(80), _step(100), INPUTS, uses_plugin=True).chosen == "plugin"  # 1.25x
    kept = decide(_step(95), _step(100), INPUTS, uses_plugin=True)  # 1.05x: within the model's error
    assert kept.chosen == "stock" and "not faster by more than the model's error (10%)" in kept.why
    assert decide(_step(95), _step(100), CostInputs(Links(1e9, 1e9), COMPUTE, margin=0.0), True).chosen == "plugin"
    refused = CostInputs(Links(1e9, 1e9), COMPUTE, refused="the lookup probe's rounds spread")
    assert decide(_step(50), _step(100), refused, uses_plugin=True).chosen == "stock"  # no range to decide on
    assert decide(_step(50), _step(100), INPUTS, uses_plugin=False).chosen == "stock"
    assert decide(_step(50), None, INPUTS, uses_plugin=True).chosen == "plugin"  # nothing to compare with


def test_unsteady_figures_decide_only_where_the_plugin_wins_across_their_range() -> None:
    refused = CostInputs(Links(1e9, 1e9), COMPUTE, refused="the lookup probe's rounds spread")
    everywhere = [(_step(50), _step(100)), (_step(70), _step(90))]  # 2.0x and 1.29x at the ends
    won = decide(_step(60), _step(100), refused, True, corners=everywhere)
    assert won.chosen == "plugin" and "at least 1.29x across the unsteady figures' range" in won.why
    somewhere = [(_step(50), _step(100)), (_step(90), _step(95))]  # 1.06x at one end: within the margin
    kept = decide(_step(60), _step(100), refused, True, corners=somewhere)
    assert kept.chosen == "stock" and "as little as 1.06x" in kept.why and "lookup probe" in kept.why


def test_a_noisy_compute_probe_still_plans_the_plugin_on_a_link_slow_enough_for_any_of_its_rounds(
    monkeypatch,
) -> None:
    """The probe's rounds spread 5x (a loaded machine): at 0.05 Gbit/s table_wise's bytes dominate
    whichever round was right, and the plugin's plan is kept; at 100 Gbit/s it is not."""
    from torchrec_het.planner import planner as planner_module
    from torchrec_het.planner.compute_probe import ComputeProbe

    noisy = ComputeProbe(2e-7, 2e-5, 1000, 0.3, False, "the lookup probe's rounds spread 5.0x twice",
                         (1e-7, 5e-7), (1e-5, 5e-5))  # fmt: skip
    monkeypatch.setattr(planner_module, "measure_compute", lambda module, batch: noisy)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    for gbit, chosen in ((0.05, "plugin"), (100.0, "stock")):
        planner = HetEmbeddingShardingPlanner(
            topology=topology, batch_size=BATCH, pricing=_pricing(), link_gbit=(gbit, None)
        )
        planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
        assert planner.decision.chosen == chosen, planner.decision.why
        assert len(planner.cost_inputs.corners) == 4 and "NOT STEADY" in planner.cost_inputs.source


def _planner(link_gbit: float) -> HetEmbeddingShardingPlanner:
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    return HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=_pricing(), link_gbit=(link_gbit, None), compute=COMPUTE
    )


def test_a_slow_link_plans_plugin_types_and_a_fast_one_keeps_torchrecs_plan() -> None:
    slow = _planner(0.5)
    plan = slow.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    assert slow.decision.chosen == "plugin" and slow.decision.plugin.total < slow.decision.stock.total / 1.1
    assert {p.sharding_type for p in plan.plan[""].values()} <= {"het_row_replicated", "het_cached_row_wise"}
    fast = _planner(1000.0)
    plan = fast.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    assert fast.decision.chosen == "stock"
    assert not {p.sharding_type for p in plan.plan[""].values()} & {"het_row_replicated", "het_cached_row_wise"}


def test_the_plan_carries_its_prediction_with_each_tables_chosen_type_and_runner_up() -> None:
    planner = _planner(0.5)
    plan = planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    prediction = prediction_of(plan)
    assert prediction is not None and prediction.chosen == "plugin"
    assert prediction.step_ms == pytest.approx(planner.decision.plugin.total * 1e3)
    assert prediction.stock_step_ms == pytest.approx(planner.decision.stock.total * 1e3)
    for name, table in prediction.tables.items():
        assert table["sharding_type"] == plan.plan[""][name].sharding_type
        assert table["runner_up"] not in (None, table["sharding_type"])
        assert table["share_ms"] <= table["runner_up_share_ms"]  # the chosen type is the cheaper one


def test_a_placed_shard_is_charged_its_traffic_times_the_ranks() -> None:
    topology = Topology(world_size=4, local_world_size=4, compute_device="cpu")
    enumerator = HetEmbeddingEnumerator(topology, BATCH, pricing=_pricing())
    enumerator.perf_estimator.costs = CostInputs(Links(1e8, 1e8), Compute(0.0, 0.0), pipeline="plain")
    options = {(o.name, o.sharding_type): o for o in enumerator.enumerate(_ebc(), [HetEmbeddingBagCollectionSharder()])}
    table_wise = options[("a", "table_wise")].shards[0].perf
    share = enumerator.perf_estimator.shares["a"]["table_wise"] * 1e3  # what one rank waits for
    assert table_wise.fwd_comms + table_wise.bwd_comms == pytest.approx(4 * share)
    row_wise = options[("a", "row_wise")]
    assert all(
        s.perf.total == pytest.approx(enumerator.perf_estimator.shares["a"]["row_wise"] * 1e3) for s in row_wise.shards
    )


def test_without_evidence_the_plan_is_torchrecs_own_plan_with_its_own_sharder() -> None:
    """TorchRec's bag sharder offers no row_wise on CPU and the plugin's does: the plan the plugin's
    planner falls back to is the one TorchRec makes with its own sharder's types."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    tables = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=16, num_embeddings=1000 + 760 * i)
        for i in range(8)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    stock = EmbeddingShardingPlanner(topology=topology, batch_size=256).plan(ebc, [EmbeddingBagCollectionSharder()])
    planner = HetEmbeddingShardingPlanner(topology=topology, batch_size=256, compute=COMPUTE)
    plan = planner.plan(ebc, [HetEmbeddingBagCollectionSharder()])
    assert planner.decision.chosen == "stock"
    got = {n: (p.sharding_type, p.ranks) for n, p in plan.plan[""].items()}
    assert got == {n: (p.sharding_type, p.ranks) for n, p in stock.plan[""].items()}


@pytest.mark.parametrize("value", ["fast,1", "100", "0,20", "100,-1", "100,20,3"])
def test_a_bad_stated_compute_names_its_variable_before_anything_starts(monkeypatch, value: str) -> None:
    import torchrec_het
    from torchrec_het.integration.env_settings import check_environment

    monkeypatch.setenv("TORCHREC_HET_STEP_COMPUTE", value)
    with pytest.raises(ValueError, match="TORCHREC_HET_STEP_COMPUTE"):
        check_environment()  # what the launcher runs before torchrun
    with pytest.raises(ValueError, match="TORCHREC_HET_STEP_COMPUTE"):
        torchrec_het.install()


def test_stated_compute_is_priced_and_no_probe_runs(monkeypatch) -> None:
    """``$TORCHREC_HET_STEP_COMPUTE`` (or ``install(step_compute=...)``) replaces the plan-time probe."""
    import torchrec_het
    from torchrec_het.planner import planner as planner_module

    def no_probe(*args):
        raise AssertionError("the compute probe ran although the compute was stated")

    monkeypatch.setattr(planner_module, "measure_compute", no_probe)
    monkeypatch.setenv("TORCHREC_HET_STEP_COMPUTE", "200,30")
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    try:
        torchrec_het.install(link_gbit="0.05,")
        planner = HetEmbeddingShardingPlanner(topology=topology, batch_size=BATCH, pricing=_pricing())
        planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
        compute = planner.cost_inputs.compute
        assert (compute.lookup_s_per_id, compute.dense_s_per_sample) == pytest.approx((200e-9, 30e-6))
        assert "$TORCHREC_HET_STEP_COMPUTE" in compute.source and not planner.cost_inputs.refused
        torchrec_het.install(step_compute=(1e-7, 2e-5))  # the argument wins over the variable
        assert HetEmbeddingShardingPlanner.installed_compute.source == "stated (install(step_compute=...))"
        with pytest.raises(ValueError, match="install\\(step_compute=...\\)"):
            torchrec_het.install(step_compute=(1e-7,))
    finally:
        torchrec_het.uninstall()
    assert HetEmbeddingShardingPlanner.installed_compute is None


def test_with_no_plan_of_torchrecs_to_compare_with_the_decision_says_why() -> None:
    from torchrec.distributed.planner import ParameterConstraints

    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    planner = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=_pricing(), link_gbit=(0.5, None), compute=COMPUTE,
        constraints={"a": ParameterConstraints(sharding_types=["het_cached_row_wise"])},
    )  # fmt: skip
    planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    assert planner.decision.chosen == "plugin" and planner.decision.why == (
        "TorchRec's planner found no plan to compare with: the constraints allow table 'a' plugin types only "
        "(het_cached_row_wise)"
    )


def test_torchrecs_planner_failing_is_the_reason_given(monkeypatch) -> None:
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_het.planner import torchrec_peer

    def fail(self, module, sharders):
        raise PlannerError("Unable to find a plan for this model because of insufficient memory.\nMore details.")

    monkeypatch.setattr(torchrec_peer.EmbeddingShardingPlanner, "plan", fail)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    options, why = torchrec_peer.torchrec_plan(
        _ebc(), [HetEmbeddingBagCollectionSharder()], topology, BATCH, None, None
    )
    assert options is None
    assert why == "it failed (PlannerError: Unable to find a plan for this model because of insufficient memory.)"
    assert (
        decide(_step(50), None, INPUTS, True, no_stock=why).why
        == f"TorchRec's planner found no plan to compare with: {why}"
    )


def _table(kind: str, rank_ms: float, runner: str | None, runner_ms: float | None) -> dict:
    return {"sharding_type": kind, "share_ms": rank_ms, "runner_up": runner, "runner_up_share_ms": runner_ms,
            "rank_ms": rank_ms, "runner_up_rank_ms": runner_ms}  # fmt: skip


def test_the_planner_log_groups_tables_of_one_decision_and_details_the_close_calls() -> None:
    from torchrec_het.planner.plan_prediction import PlanPrediction, table_lines

    tables = {f"t_{i}": _table("table_wise", 0.176, "row_wise", 0.214) for i in range(26)}
    tables["t_hot"] = _table("table_wise", 0.2, "het_row_replicated", 0.21)  # within 10%: a close call
    lines = table_lines(PlanPrediction(6.6, chosen="stock", tables=tables), world_size=2, margin=0.1)
    assert lines == [
        "26 tables table_wise, TorchRec's plan kept (t_0, t_1, t_2, t_3 and 22 more): 0.176 ms a rank each "
        "(its owner's 0.352 ms); runner-up row_wise 0.214 ms a rank",
        "t_hot: table_wise, TorchRec's plan kept, a close call: 0.200 ms a rank (its owner's 0.400 ms); "
        "runner-up het_row_replicated 0.210 ms a rank",
        "(ms a rank: a table's shards' predicted perf shared over the 2 ranks, what TorchRec's search balances)",
    ]
    cheaper = {"t_a": _table("table_wise", 0.3, "row_wise", 0.2)}  # TorchRec's estimator chose it
    (line, _) = table_lines(PlanPrediction(6.6, chosen="stock", tables=cheaper), world_size=2, margin=0.1)
    assert line.endswith(
        "runner-up row_wise 0.200 ms a rank: TorchRec's own planner chose table_wise (by its estimator); the plugin "
        "replaces TorchRec's plan only with plugin types predicted faster by more than 10%"
    ), line


def test_the_planner_log_compares_the_choice_with_its_runner_up_on_one_footing(caplog) -> None:
    """26 equal tables on a fast link: one line for them all, and the runner-up is no cheaper a rank
    than the choice; a table constrained to one plugin type has no runner-up (not the row_wise
    stand-in the enumerator prices for it)."""
    from torchrec.distributed.planner import ParameterConstraints

    sizes = {f"t_{i}": 20_000 for i in range(26)}
    tables = [EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=16, num_embeddings=r)
              for n, r in sizes.items()]  # fmt: skip
    counts = tuple((zipf_shares(r, 1.1) * BATCH).floor().long() for r in sizes.values())
    pricing = PluginPricing(AccessModel(AccessProfile(tuple(sizes), tuple(sizes.values()), counts, 4)))
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    planner = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=pricing, link_gbit=(1000.0, None), compute=COMPUTE
    )
    caplog.set_level(logging.INFO, logger="torchrec.distributed.planner.stats")
    plan = planner.plan(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")), [HetEmbeddingBagCollectionSharder()]
    )
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torchrec_het tables: ")]
    assert planner.decision.chosen == "stock" and len(logged) == 2, logged  # one group, one key
    assert logged[0].startswith("torchrec_het tables: 26 tables "), logged
    for table in prediction_of(plan).tables.values():
        assert table["runner_up_rank_ms"] >= table["rank_ms"], table

    constrained = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=_pricing(), link_gbit=(0.5, None), compute=COMPUTE,
        constraints={"a": ParameterConstraints(sharding_types=["het_cached_row_wise"])},
    )  # fmt: skip
    table = prediction_of(constrained.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])).tables["a"]
    assert table["sharding_type"] == "het_cached_row_wise" and table["runner_up"] is None, table
