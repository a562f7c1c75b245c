"""The run-time plan check: the measured step against the plan's prediction (torchrec_het.integration.plan_check)."""

import copy
import logging
import pickle

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan

import torchrec_het
from torchrec_het.integration.plan_check import PlanPrediction, StepWatch, attach_prediction, prediction_of, watch_plan

PREDICTION = PlanPrediction(
    step_ms=100.0,
    pipeline="sparse_dist",
    parts_ms={"emb_fwd": 20.0, "emb_bwd": 30.0, "dense": 40.0, "comm_wait": 10.0},
    tables={
        "t_a": {"sharding_type": "table_wise", "share_ms": 12.5, "runner_up": "row_wise", "runner_up_share_ms": 14.0},
        "t_b": {"sharding_type": "het_cached_row_wise", "share_ms": 3.0, "runner_up": None, "runner_up_share_ms": None},
    },
    source="links: stated 10 Gbit/s; compute: shipped table",
    stock_step_ms=120.0,
)


class FakeClock:
    """Advances ``step_s`` seconds each time the watch reads it (one read per training forward)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.reads = 0.0, step_s, 0

    def __call__(self) -> float:
        self.now += self.step_s
        self.reads += 1
        return self.now


def watched(step_ms: float, warmup: int = 2, window: int = 5) -> tuple[torch.nn.Module, StepWatch, FakeClock]:
    model, clock = torch.nn.Linear(2, 2), FakeClock(step_ms / 1e3)
    return model, watch_plan(model, PREDICTION, warmup=warmup, window=window, clock=clock), clock


def train(model: torch.nn.Module, steps: int) -> None:
    model.train()
    for _ in range(steps):
        model(torch.ones(1, 2))


@pytest.fixture(autouse=True)
def always_uninstall():
    yield
    torchrec_het.uninstall()


def test_forty_percent_slower_logs_one_line_with_both_figures_and_advice(caplog, capsys) -> None:
    model, watch, _ = watched(140.0)
    with caplog.at_level(logging.WARNING, logger="torchrec_het"):
        train(model, 2 + 1 + 4)  # warm-up, the first timed forward, 4 of the 5 intervals
        assert watch.measured_step_ms is None and not caplog.records
        train(model, 3)
    assert watch.measured_step_ms == pytest.approx(140.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "torchrec_het"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "torchrec_het: plan check: measured 140.0 ms/step, the plan predicted 100.0 ms (sparse_dist), 40% slower: "
        "the planner's figures (figures: links: stated 10 Gbit/s; compute: shipped table) overrate this machine"
    ), lines[0]
    for advice in ("OMP_NUM_THREADS", "TORCHREC_HET_LINK_GBIT", "TORCHREC_HET_COMPUTE_COSTS", "re-plan"):
        assert advice in lines[0]
    # a handler shows the record (here caplog's): no second copy on stderr
    assert capsys.readouterr().err.count("torchrec_het: plan check:") == 0


def test_the_line_goes_to_stderr_only_where_no_handler_shows_it() -> None:
    from torchrec_het.planner.stats import shown

    lonely = logging.Logger("lonely")  # no parent, no handler: the check prints the line itself
    assert not shown(lonely, logging.WARNING)
    lonely.addHandler(logging.NullHandler())
    assert not shown(lonely, logging.WARNING)
    lonely.addHandler(logging.StreamHandler())
    assert shown(lonely, logging.WARNING)


def test_forty_percent_faster_says_the_plan_was_priced_pessimistically(caplog) -> None:
    model, watch, _ = watched(60.0)
    with caplog.at_level(logging.WARNING, logger="torchrec_het"):
        train(model, 20)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "torchrec_het"]
    assert "measured 60.0 ms/step, the plan predicted 100.0 ms (sparse_dist), 40% faster: " in line
    assert "priced pessimistically" in line and "overrate" not in line and "TORCHREC_HET_LINK_GBIT" in line


def test_within_a_quarter_nothing_is_logged(caplog, capsys) -> None:
    model, watch, _ = watched(110.0)
    with caplog.at_level(logging.DEBUG, logger="torchrec_het"):
        train(model, 20)
    assert watch.measured_step_ms == pytest.approx(110.0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "plan check" not in capsys.readouterr().err


def test_only_rank_zero_logs(caplog, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    model, watch, _ = watched(200.0)
    with caplog.at_level(logging.WARNING, logger="torchrec_het"):
        train(model, 20)
    assert watch.measured_step_ms == pytest.approx(200.0) and not caplog.records


def test_eval_forwards_are_not_counted_and_break_the_interval() -> None:
    model, watch, clock = watched(100.0, warmup=0, window=3)
    train(model, 2)  # one interval
    model.eval()
    model(torch.ones(1, 2))
    clock.now += 5.0  # a slow evaluation: its time must not show in the step
    model(torch.ones(1, 2))
    train(model, 1)  # follows an eval forward: no interval
    assert watch.steps_seen == 3 and watch.measured_step_ms is None
    train(model, 2)
    assert watch.steps_seen == 5 and watch.measured_step_ms == pytest.approx(100.0)


def test_the_hook_is_removed_after_the_window() -> None:
    model, watch, clock = watched(100.0, warmup=1, window=2)
    assert len(model._forward_pre_hooks) == 1 and watch.watching
    train(model, 4)  # warm-up step, the first timed forward, two intervals
    assert watch.measured_step_ms is not None and not watch.watching
    assert len(model._forward_pre_hooks) == 0
    reads = clock.reads
    train(model, 5)
    assert clock.reads == reads and watch.steps_seen == 4  # no cost afterwards


def test_a_copied_model_times_nothing_and_leaves_the_original_watched() -> None:
    model, watch, clock = watched(100.0, warmup=0, window=3)
    train(model, 1)
    twin = copy.deepcopy(model)
    train(twin, 10)
    unpickled = pickle.loads(pickle.dumps(model))  # the model with its hook and watch pickles
    train(unpickled, 10)
    assert clock.reads == 1 and watch.watching and len(model._forward_pre_hooks) == 1
    for copied in (twin, unpickled):
        assert not copied._het_step_watch.watching and copied._het_step_watch.steps_seen == 1
    train(model, 3)
    assert watch.measured_step_ms == pytest.approx(100.0) and len(model._forward_pre_hooks) == 0


def test_a_sharding_plan_keeps_its_prediction_through_pickle() -> None:
    tables = [EmbeddingBagConfig(name="t_a", feature_names=["f_a"], embedding_dim=4, num_embeddings=8)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(
        ebc, {"t_a": table_wise(rank=0)}, local_size=1, world_size=1, device_type="cpu"
    )
    plan = attach_prediction(ShardingPlan({"ebc": module_plan}), PREDICTION)
    back = pickle.loads(pickle.dumps(plan))
    assert prediction_of(back) == PREDICTION and back.plan.keys() == plan.plan.keys()
    assert prediction_of(ShardingPlan({})) is None
    with pytest.raises(ValueError, match="carries no prediction"):
        watch_plan(torch.nn.Linear(1, 1), ShardingPlan({}))


def test_stats_by_table_carries_the_plan_check() -> None:
    model, watch, _ = watched(140.0)
    assert torchrec_het.stats_by_table(torch.nn.Linear(1, 1)) == {}
    stats = torchrec_het.stats_by_table(model)
    assert set(stats) == {"t_a", "t_b"}
    assert stats["t_a"] == {
        "module": None,
        "sharding_type": "table_wise",
        "plan_check": {
            "predicted_step_ms": 100.0,
            "measured_step_ms": None,
            "steps": 0,
            "predicted_share_ms": 12.5,
            "runner_up": "row_wise",
            "runner_up_share_ms": 14.0,
        },
    }
    train(model, 10)
    check = torchrec_het.stats_by_table(model)["t_b"]["plan_check"]
    assert check["measured_step_ms"] == pytest.approx(140.0) and check["steps"] == 8
    assert check["runner_up"] is None and check["predicted_share_ms"] == 3.0


class TwoTables(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=8)
            for n in ("t_a", "t_b")
        ]
        self.ebc = EmbeddingBagCollection(tables=tables)

    def forward(self, features):
        return self.ebc(features)


def test_install_makes_dmp_watch_a_plan_with_a_prediction(one_rank_env) -> None:
    model = TwoTables()
    module_plan = construct_module_sharding_plan(
        model.ebc,
        {"t_a": table_wise(rank=0), "t_b": table_wise(rank=0)},
        local_size=1,
        world_size=1,
        device_type="cpu",
        sharder=EmbeddingBagCollectionSharder(),
    )
    torchrec_het.install()

    def dmp(plan: ShardingPlan) -> DistributedModelParallel:
        return DistributedModelParallel(
            TwoTables(), env=one_rank_env, device=torch.device("cpu"), plan=plan, init_data_parallel=False
        )

    assert not hasattr(dmp(ShardingPlan({"ebc": module_plan})), "_het_step_watch")  # no prediction, no watch
    model = dmp(attach_prediction(ShardingPlan({"ebc": module_plan}), PREDICTION))
    watch = model._het_step_watch
    assert isinstance(watch, StepWatch) and watch.prediction == PREDICTION and watch.watching
    assert watch.table_modules == {"t_a": "ebc", "t_b": "ebc"}
    assert torchrec_het.stats_by_table(model)["t_a"]["module"] == "ebc"
    torchrec_het.uninstall()
    assert not hasattr(dmp(attach_prediction(ShardingPlan({"ebc": module_plan}), PREDICTION)), "_het_step_watch")
