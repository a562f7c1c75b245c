"""A trainer that starts its own ranks (``torch.multiprocessing.spawn``, as TorchRec's
``benchmark_train_pipeline`` does) plans with the plugin on every rank when started through
``python -m torchrec_het.launch``, with the launcher's settings, and with TorchRec's planner without
it; the hook that gets it there (:mod:`torchrec_het.integration.child_install`) in one process."""

import multiprocessing.spawn
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het.integration import child_install
from torchrec_het_testing.stated_plan_figures import SLOW_LINK_PLAN

REPO = Path(__file__).resolve().parents[2]
TRAINER = str(REPO / "tests" / "recipes" / "spawning_trainer.py")
RANK_LINE = re.compile(r"^rank (\d) planner (\w+) sharder (\w+) offers (\S+) planned (\S+)$", re.M)


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> dict[str, str]:
    """A stated skew, slow links, fixed compute and lookups on par with row_wise's: the plugin's
    cache wins the trainer's tables, so a rank that plans it got the launcher's settings."""
    from torchrec_het.planner.compute_costs import save_bytes_only_table

    costs = save_bytes_only_table(tmp_path_factory.mktemp("costs") / "on_par.json", "tests: on par")
    return dict(
        SLOW_LINK_PLAN, TORCHREC_HET_ALPHA="1.05", TORCHREC_HET_COMPUTE_COSTS=str(costs), TORCHREC_HET_LINK_PROBE="0"
    )


def _run(argv: list[str], settings: dict[str, str], cwd: Path) -> tuple[dict[int, tuple[str, ...]], str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **settings)
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = {int(m[0]): m[1:] for m in RANK_LINE.findall(done.stdout)}
    assert sorted(ranks) == [0, 1], done.stdout
    return ranks, done.stdout, done.stderr


def test_ranks_a_script_spawns_plan_with_the_plugin_through_the_launcher(settings, tmp_path: Path) -> None:
    ranks, stdout, stderr = _run(["-m", "torchrec_het.launch", TRAINER], settings, tmp_path)
    for planner, sharder, offered, planned in ranks.values():
        assert (planner, sharder) == ("HetEmbeddingShardingPlanner", "HetEmbeddingBagCollectionSharder"), ranks
        assert "het_cached_row_wise" in offered.split(","), offered
        assert planned == "het_cached_row_wise", ranks  # the stated skew, links and costs reached the rank
    assert "helper sum 6" in stdout  # a spawned worker that is no TorchRec job, unharmed
    rules = [line for line in stderr.splitlines() if line.startswith("torchrec_het: no access profile; stated skew")]
    assert len(rules) == 1, stderr[-3000:]  # said once, by the launcher's worker; the children install quietly


def test_without_the_launcher_the_same_ranks_plan_stock(settings, tmp_path: Path) -> None:
    ranks, stdout, _ = _run([TRAINER], settings, tmp_path)
    for planner, sharder, offered, planned in ranks.values():
        assert (planner, sharder) == ("EmbeddingShardingPlanner", "EmbeddingBagCollectionSharder"), ranks
        assert not {"het_cached_row_wise", "het_row_replicated"} & {*offered.split(","), planned}, ranks
    assert "helper sum 6" in stdout


def test_the_preparation_data_installs_the_plugin_where_it_is_unpickled(monkeypatch) -> None:
    """What a spawned child does first: unpickle the preparation data (before it imports ``__main__``)."""
    monkeypatch.setattr(multiprocessing.spawn, "get_preparation_data", multiprocessing.spawn.get_preparation_data)
    child_install.reach_spawned_children()
    wrapped = multiprocessing.spawn.get_preparation_data
    child_install.reach_spawned_children()  # idempotent: wrapped once
    assert multiprocessing.spawn.get_preparation_data is wrapped
    data = wrapped("SpawnProcess-1")
    assert {"sys_path", "dir", child_install.PREPARATION_KEY} <= set(data)
    del data["authkey"]  # multiprocessing pickles it only while it starts a process
    from torchrec_het.integration import registration

    calls = []
    monkeypatch.setattr(registration, "install", lambda **kwargs: calls.append(kwargs))
    loaded = pickle.loads(pickle.dumps(data))
    assert calls == [{"announce": False}] and loaded["sys_path"] == data["sys_path"]  # quietly: the parent said it


def test_a_child_without_torchrec_is_left_alone(monkeypatch) -> None:
    import importlib.util

    from torchrec_het.integration import registration

    stock = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchrec" else stock(name, *a))
    monkeypatch.setattr(registration, "install", lambda **kwargs: pytest.fail("installed without TorchRec"))
    monkeypatch.setattr(multiprocessing.spawn, "get_preparation_data", multiprocessing.spawn.get_preparation_data)
    before = multiprocessing.spawn.get_preparation_data
    child_install.install_in_child()
    assert multiprocessing.spawn.get_preparation_data is before


def test_installing_in_a_child_twice_is_one_installation(monkeypatch, capsys) -> None:
    """The hook, then the script's own ``install()``: one set of patches, which ``uninstall()`` takes out."""
    import torchrec.distributed.model_parallel as model_parallel
    import torchrec.distributed.planner as planner

    from torchrec_het.integration import registration

    monkeypatch.setattr(multiprocessing.spawn, "get_preparation_data", multiprocessing.spawn.get_preparation_data)
    stock_planner, stock_sharders = planner.EmbeddingShardingPlanner, model_parallel.get_default_sharders
    child_install.install_in_child()
    child_install.install_in_child()
    try:
        het_planner = planner.EmbeddingShardingPlanner
        assert registration.installed() and het_planner.__name__ == "HetEmbeddingShardingPlanner"
        assert not hasattr(het_planner.plan.__wrapped__, "__wrapped__")  # the sharder swap wraps plan once
    finally:
        registration.uninstall()
    assert planner.EmbeddingShardingPlanner is stock_planner and model_parallel.get_default_sharders is stock_sharders
    assert "torchrec_het:" not in capsys.readouterr().err  # quiet: the launcher's worker said which rule applies
