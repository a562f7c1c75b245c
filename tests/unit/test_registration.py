"""``torchrec_het.install()`` / ``uninstall()``: explicit, complete, reversible; nothing on import."""

import subprocess
import sys

import pytest
import torch
import torchrec.distributed.model_parallel as model_parallel
import torchrec.distributed.planner as planner_package
import torchrec.distributed.sharding_plan as sharding_plan
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import Topology

import torchrec_het
from torchrec_het.planner import HetEmbeddingShardingPlanner, zipf_shares
from torchrec_het.replication.profile import AccessProfile, save_profile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder

STOCK_PLANNER = planner_package.EmbeddingShardingPlanner
STOCK_DEFAULTS = sharding_plan.get_default_sharders


@pytest.fixture(autouse=True)
def always_uninstall():
    yield
    torchrec_het.uninstall()


def test_importing_the_package_changes_nothing() -> None:
    code = (
        "import torchrec_het, torchrec_het.sharders, torchrec_het.planner, torchrec_het_bench.configs\n"
        "import torchrec.distributed.planner as p\n"
        "from torchrec.distributed.model_parallel import get_default_sharders\n"
        "from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder\n"
        "assert p.EmbeddingShardingPlanner.__module__ == 'torchrec.distributed.planner.planners'\n"
        "assert type(get_default_sharders()[0]) is EmbeddingBagCollectionSharder\n"
        "print('unchanged')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "unchanged" in run.stdout, run.stderr[-2000:]


def test_install_swaps_the_sharders_and_the_planner_and_uninstall_restores_them() -> None:
    stock_types = [type(s) for s in model_parallel.get_default_sharders()]
    torchrec_het.install()
    swapped = [type(s) for s in model_parallel.get_default_sharders()]
    assert swapped[stock_types.index(EmbeddingBagCollectionSharder)] is HetEmbeddingBagCollectionSharder
    assert swapped[stock_types.index(EmbeddingCollectionSharder)] is HetEmbeddingCollectionSharder
    assert [t for t in swapped if t not in (HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder)] == [
        t for t in stock_types if t not in (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder)
    ]
    for home in (planner_package, model_parallel):
        assert home.EmbeddingShardingPlanner is HetEmbeddingShardingPlanner
    torchrec_het.install()  # again: still one layer deep
    torchrec_het.uninstall()
    assert [type(s) for s in model_parallel.get_default_sharders()] == stock_types
    assert sharding_plan.get_default_sharders is STOCK_DEFAULTS
    assert planner_package.EmbeddingShardingPlanner is STOCK_PLANNER
    assert model_parallel.EmbeddingShardingPlanner is STOCK_PLANNER
    torchrec_het.uninstall()  # a no-op when not installed


def test_a_stock_looking_planner_plans_plugin_types_after_install(tmp_path, monkeypatch) -> None:
    sizes = {"a": 100_000, "b": 50_000}
    # rows wide enough (128) that the bytes saved outweigh the lookups' measured compute (compute_costs.json)
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=128, num_embeddings=r)
        for n, r in sizes.items()
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    counts = tuple((zipf_shares(r, 1.1) * 512 * 4).floor().long() for r in sizes.values())
    path = str(tmp_path / "profile.pt")
    save_profile(AccessProfile(tuple(sizes), tuple(sizes.values()), counts, 4), path)
    monkeypatch.setenv("TORCHREC_HET_PROFILE", path)  # how the launcher passes a profile

    def plan_like_a_trainer() -> set[str]:
        planner = planner_package.EmbeddingShardingPlanner(
            topology=Topology(world_size=8, local_world_size=4, compute_device="cpu"), batch_size=512
        )
        plan = planner.plan(ebc, model_parallel.get_default_sharders())
        return {p.sharding_type for p in plan.plan[""].values()}

    assert not plan_like_a_trainer() & {"het_row_replicated", "het_cached_row_wise"}
    torchrec_het.install()
    assert "het_row_replicated" in plan_like_a_trainer()
    torchrec_het.uninstall()
    assert not plan_like_a_trainer() & {"het_row_replicated", "het_cached_row_wise"}


def test_a_bad_profile_path_fails_install_and_leaves_torchrec_unchanged(tmp_path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a profile")
    with pytest.raises(ValueError, match="bad.pt"):
        torchrec_het.install(profile=str(bad))
    assert planner_package.EmbeddingShardingPlanner is STOCK_PLANNER
    assert type(model_parallel.get_default_sharders()[0]) is EmbeddingBagCollectionSharder


def test_get_het_sharders_is_the_one_line_swap_without_installing() -> None:
    from torchrec_het.sharders import get_het_sharders

    stock, het = model_parallel.get_default_sharders(), get_het_sharders()
    assert len(stock) == len(het)
    swapped = {
        EmbeddingBagCollectionSharder: HetEmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder: HetEmbeddingCollectionSharder,
    }
    assert [type(s) for s in het] == [swapped.get(type(s), type(s)) for s in stock]
    assert [s.module_type for s in het] == [s.module_type for s in stock]  # DMP matches sharders by module type
    assert planner_package.EmbeddingShardingPlanner is STOCK_PLANNER  # nothing installed


def test_embedding_staleness_makes_sparse_dist_the_hybrid_pipeline_until_uninstall(monkeypatch) -> None:
    import torchrec.distributed as distributed
    import torchrec.distributed.train_pipeline as train_pipeline

    from torchrec_het.pipeline import HybridTrainPipeline

    stock = train_pipeline.TrainPipelineSparseDist
    torchrec_het.install()
    assert train_pipeline.TrainPipelineSparseDist is stock  # not asked for: TorchRec's own
    monkeypatch.setenv("TORCHREC_HET_EMBEDDING_STALENESS", "2")  # how the launcher passes it
    torchrec_het.install()
    installed = train_pipeline.TrainPipelineSparseDist
    assert issubclass(installed, HybridTrainPipeline) and distributed.TrainPipelineSparseDist is installed
    torchrec_het.uninstall()
    assert train_pipeline.TrainPipelineSparseDist is stock and distributed.TrainPipelineSparseDist is stock


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_embedding_staleness_names_the_variable_and_changes_nothing(monkeypatch, value: str) -> None:
    monkeypatch.setenv("TORCHREC_HET_EMBEDDING_STALENESS", value)
    with pytest.raises(ValueError, match="TORCHREC_HET_EMBEDDING_STALENESS"):
        torchrec_het.install()
    assert (
        sharding_plan.get_default_sharders is STOCK_DEFAULTS
        and planner_package.EmbeddingShardingPlanner is STOCK_PLANNER
    )


def _two_tables() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=32, num_embeddings=50_000)
        for n in ("a", "b")
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _plan_types(ebc: EmbeddingBagCollection) -> dict[str, str]:
    planner = planner_package.EmbeddingShardingPlanner(
        topology=Topology(world_size=2, local_world_size=2, compute_device="cpu"), batch_size=512
    )
    return {n: p.sharding_type for n, p in planner.plan(ebc, model_parallel.get_default_sharders()).plan[""].items()}


def test_without_a_profile_install_says_so_and_the_planner_plans_stock_types(monkeypatch, capsys) -> None:
    for name in ("TORCHREC_HET_PROFILE", "TORCHREC_HET_ALPHA", "TORCHREC_HET_ONLINE_PROFILE_STEPS", "RANK"):
        monkeypatch.delenv(name, raising=False)
    torchrec_het.install()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "torchrec_het: no access profile: the planner offers only TorchRec's sharding types; profile your batches "
        "(python -m torchrec_het_bench.profile, or torchrec_het.replication.AccessProfiler on your own batches) and set "
        "$TORCHREC_HET_PROFILE (or install(profile=...)) to let it choose the plugin's"
    ]
    assert not set(_plan_types(_two_tables()).values()) & {"het_row_replicated", "het_cached_row_wise"}
    monkeypatch.setenv("TORCHREC_HET_ONLINE_PROFILE_STEPS", "3")  # counted after planning: no evidence
    torchrec_het.install()
    assert "TORCHREC_HET_ONLINE_PROFILE_STEPS=3 counts reads only after planning" in capsys.readouterr().err
    assert not set(_plan_types(_two_tables()).values()) & {"het_row_replicated", "het_cached_row_wise"}
    err = capsys.readouterr().err.splitlines()
    plan_lines = [line for line in err if line.startswith("torchrec_het: plan:")]
    assert [line for line in err if line not in plan_lines] == [  # when it plans, it says what links it priced
        "torchrec_het: links (per rank, all ranks sending at once): within a host 16 Gbit/s (assumed: gloo over TCP; "
        "plan() has no process group), between hosts 10 Gbit/s (assumed: gloo over TCP; one host)",
    ]
    assert plan_lines[0].startswith(
        "torchrec_het: plan: TorchRec's plan: no table may take a plugin type (no profile or stated skew names one, "
        "no constraint names one); the plan's predicted step: "
    )
    monkeypatch.setenv("RANK", "1")  # one line per job: rank 0's
    torchrec_het.install()
    assert capsys.readouterr().err == ""


def test_the_plan_decision_is_printed_once_where_the_planner_log_shows_it(monkeypatch, capsys) -> None:
    """Under install() rank 0 prints the decision on stderr; a trainer that shows the planner's
    log (the recipe's --print-plan) has it there already, and gets it once."""
    import logging

    from torchrec.distributed.planner.stats import logger as stats_logger

    for name in ("TORCHREC_HET_PROFILE", "TORCHREC_HET_ALPHA", "TORCHREC_HET_ONLINE_PROFILE_STEPS", "RANK"):
        monkeypatch.delenv(name, raising=False)
    torchrec_het.install()
    _plan_types(_two_tables())
    assert sum(line.startswith("torchrec_het: plan:") for line in capsys.readouterr().err.splitlines()) == 1
    shown: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: shown.append(record.getMessage())
    level, propagate = stats_logger.level, stats_logger.propagate
    stats_logger.setLevel(logging.INFO)  # as the recipe's --print-plan: INFO to a handler of its own
    stats_logger.addHandler(handler)
    stats_logger.propagate = False
    try:
        _plan_types(_two_tables())
    finally:
        stats_logger.removeHandler(handler)
        stats_logger.setLevel(level)
        stats_logger.propagate = propagate
    assert "torchrec_het: plan:" not in capsys.readouterr().err
    assert sum(line.startswith("torchrec_het plan:") for line in shown) == 1, shown


def test_a_profile_or_a_stated_skew_is_named_on_stderr(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    path = str(tmp_path / "p.pt")
    save_profile(AccessProfile(("a",), (50_000,), ((zipf_shares(50_000, 1.1) * 2048).floor().long(),), 4), path)
    torchrec_het.install(profile=path)
    assert capsys.readouterr().err.splitlines() == [
        f"torchrec_het: access profile {path} (1 tables, 4 batches): the planner may choose the plugin's types for "
        "the tables it names, TorchRec's types for the others"
    ]
    assert _plan_types(_two_tables())["b"] not in {"het_row_replicated", "het_cached_row_wise"}  # not profiled
    monkeypatch.setenv("TORCHREC_HET_ALPHA", "1.05")
    torchrec_het.install()
    assert "stated skew Zipf(1.05) ($TORCHREC_HET_ALPHA or install(alpha=...))" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b"not a profile", "empty"])
def test_a_missing_unreadable_or_empty_profile_names_the_variable_and_the_path(tmp_path, monkeypatch, content) -> None:
    path = tmp_path / "p.pt"
    if content == "empty":
        save_profile(AccessProfile(("a",), (3,), (torch.zeros(3, dtype=torch.int64),), 0), str(path))
    elif content is not None:
        path.write_bytes(content)
    monkeypatch.setenv("TORCHREC_HET_PROFILE", str(path))
    expected = {
        None: "no such access profile file",
        b"not a profile": "cannot read the access profile",
        "empty": "is empty",
    }[content]
    with pytest.raises(ValueError, match=expected) as raised:
        torchrec_het.install()
    assert str(path) in str(raised.value)
    if content != "empty":
        assert f"$TORCHREC_HET_PROFILE='{path}'" in str(raised.value)
    assert planner_package.EmbeddingShardingPlanner is STOCK_PLANNER


@pytest.mark.parametrize("name,value", [("TORCHREC_HET_ALPHA", "-1"), ("TORCHREC_HET_ALPHA", "zipf"),
                                        ("TORCHREC_HET_REPLICA_SYNC_EVERY", "0"), ("TORCHREC_HET_ONLINE_PROFILE_STEPS", "x")])  # fmt: skip
def test_a_bad_setting_names_its_variable(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        torchrec_het.install()


def test_get_het_sharders_takes_the_profile_the_planner_priced(tmp_path) -> None:
    from torchrec_het.planner import ProfileTiers
    from torchrec_het.replication import ReplicationConfig
    from torchrec_het.sharders import get_het_sharders

    profile = AccessProfile(("a",), (10,), (torch.arange(10, dtype=torch.int64),), 2)
    path = str(tmp_path / "p.pt")
    save_profile(profile, path)
    for given in (profile, path):
        sharders = get_het_sharders(profile=given, replication=ReplicationConfig(replica_sync_every=2))
        het = [s for s in sharders if isinstance(s, (HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder))]
        assert len(het) == 2
        for sharder in het:
            tiers = sharder._replication.tiers
            assert (
                isinstance(tiers, ProfileTiers)
                and tiers.replica_sync_every == 2
                and sharder._replication.replica_sync_every == 2
            )
    with pytest.raises(ValueError, match="either profile= or ReplicationConfig"):
        get_het_sharders(profile=profile, replication=ReplicationConfig(tiers=ProfileTiers(profile)))


def test_a_compute_cost_table_of_ones_own_machines_prices_the_plan(tmp_path, monkeypatch) -> None:
    """``$TORCHREC_HET_COMPUTE_COSTS`` (how the launcher passes it) replaces the shipped table; a
    bad one names the variable and changes nothing."""
    import json

    from torchrec_het.planner.compute_costs import COSTS_PATH, load_compute_costs

    doc = json.loads(COSTS_PATH.read_text())
    doc["extra_seconds_per_id"]["het_cached_row_wise"]["stale"] = 7e-6
    mine = tmp_path / "costs.json"
    mine.write_text(json.dumps(doc))
    monkeypatch.setenv("TORCHREC_HET_COMPUTE_COSTS", str(mine))
    try:
        torchrec_het.install()
        pricing = torchrec_het.integration.registration.installed_pricing()
        assert pricing.compute.per_id("het_cached_row_wise", "stale") == 7e-6
        assert pricing.compute == load_compute_costs(mine)
    finally:
        torchrec_het.uninstall()
    monkeypatch.setenv("TORCHREC_HET_COMPUTE_COSTS", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"\$TORCHREC_HET_COMPUTE_COSTS=.*missing\.json"):
        torchrec_het.install()
    assert not torchrec_het.integration.registration.installed()
    with pytest.raises(ValueError, match=r"\$TORCHREC_HET_COMPUTE_COSTS"):
        torchrec_het.integration.env_settings.check_environment()  # what the launcher runs before any worker


def test_lookahead_comes_from_install_or_the_environment_and_reaches_the_sharders_options(monkeypatch) -> None:
    from torchrec_het.integration import registration

    monkeypatch.setenv("TORCHREC_HET_LOOKAHEAD", "1")
    try:
        torchrec_het.install()
        assert registration._state.replication.lookahead
        assert registration._state.replication.table_options("t", 2).lookahead  # what the plan carries
        torchrec_het.install(lookahead=False)  # the argument wins
        assert not registration._state.replication.lookahead
        monkeypatch.setenv("TORCHREC_HET_LOOKAHEAD", "maybe")
        with pytest.raises(ValueError, match="TORCHREC_HET_LOOKAHEAD"):
            torchrec_het.install()
        monkeypatch.setenv("TORCHREC_HET_LOOKAHEAD", "1")
        monkeypatch.setenv("TORCHREC_HET_ONLINE_PROFILE_STEPS", "3")
        with pytest.raises(ValueError, match="lookahead needs the hot rows known"):
            torchrec_het.install()
    finally:
        torchrec_het.uninstall()
