"""Which of TorchRec's train pipelines run on CPU with the installed TorchRec (1.8.0 or 1.9.2), on a stock
table_wise DLRM across 2 gloo ranks, and that the benchmark's refusals quote the errors the others
raise (rank bodies: :mod:`torchrec_het_testing.cpu_pipeline_ranks`). When a TorchRec release makes one
of them run on CPU, a test here fails: then the benchmark should offer it as a peer."""

import math
import re

import pytest
import torch

from torchrec_het import _compat
from torchrec_het_bench.pipelines import PIPELINES, PipelineUnavailable, check_pipeline
from torchrec_het_testing.cpu_pipeline_ranks import STEPS, run_world
from torchrec_het_testing.spawn import spawn_world

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    # spawned, as a user's ranks start: a forked rank meets CUDA with another error than the one quoted
    return spawn_world(run_world, 2, tmp_path_factory.mktemp("cpu_pipelines"), warm=False)


def quoted_error(why_not: str) -> str:
    """The TorchRec error a refusal quotes: its ('...')."""
    return re.search(r"\('([^']+)'\)", why_not).group(1)


def test_the_pipelines_the_benchmark_runs_on_cpu_train(world) -> None:
    for rank, result in enumerate(world):
        for name in ("sparse_dist", "semi_sync_adapted"):
            assert result[name].get("steps") == STEPS, (rank, name, result[name])
            assert all(math.isfinite(loss) for loss in result[name]["losses"]), (rank, name, result[name])
    for name in ("sparse_dist", "semi_sync"):
        assert check_pipeline(name, CPU) is PIPELINES[name]


def test_torchrecs_semi_sync_still_needs_the_cpu_adapter(world) -> None:
    for result in world:
        stock = result["semi_sync_stock"]
        assert stock.get("error") == "RuntimeError: unknown parameter type", stock  # record_stream on a CPU tensor
        assert "record_stream" in stock["where"], stock


@pytest.mark.parametrize("name", ["prefetch_sparse_dist", "pec"])
def test_a_pipeline_the_benchmark_refuses_on_cpu_fails_there_with_the_error_it_quotes(world, name) -> None:
    kind = PIPELINES[name]
    with pytest.raises(PipelineUnavailable, match=f"--pipeline {name} cannot run"):
        check_pipeline(name, CPU)
    if name == "pec" and _compat.pec_train_pipeline_class() is None:
        assert world[0]["torchrec"].startswith("1.8.") and name not in world[0]
        assert kind.device_types == () and "new in TorchRec 1.9" in kind.why_not
        return
    for rank, result in enumerate(world):
        assert "error" in result[name], (rank, name, result[name])  # it ran: offer it as a peer on CPU
        assert quoted_error(kind.why_not) in result[name]["error"], (rank, name, result[name], kind.why_not)
