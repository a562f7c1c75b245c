"""TorchRec benchmark-shaped training (power-law ids, about 20 per bag, tables of 10^5 rows, a batch
of 1,024 per rank, fused row-wise Adagrad, 24 steps under ``TrainPipelineSparseDist``): the
plugin's ``het_row_replicated`` and CPU ``row_wise`` give stock table_wise's outputs at every step,
within float tolerance, and never a NaN (rank bodies: :mod:`torchrec_het_testing.multi_hot_ranks`).

Float tolerance: the first steps within 1e-4 of logits of about 5; later steps within 3e-3. A hot
row's gradient sums some 10^4 values whose signs differ; ``het_row_replicated`` sums them per row and
then over the ranks, FBGEMM in its own order, so their rounding differs by up to 1e-4 of the row,
and row-wise Adagrad turns the rounding of a gradient that nearly cancels into a different direction
of that row's step (TorchRec's own row_wise shows it too, smaller: its owner sums in FBGEMM's order).
A lost or stale update moves every sample that reads the row by 1e-2 or more."""

import math

import pytest
import torch

from torchrec_het_testing.multi_hot_ranks import KINDS, STEPS, run_world
from torchrec_het_testing.spawn import spawn_world

FIRST_STEPS = 6


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"multi_hot_ws{request.param}"))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "table_wise"])
def test_every_step_gives_stock_table_wise_outputs(world: list[dict], kind: str) -> None:
    for rank, results in enumerate(world):
        stock, plugin = results["table_wise"], results[kind]
        assert len(plugin["logits"]) == STEPS
        assert all(math.isfinite(loss) for loss in plugin["losses"]), (rank, plugin["losses"])
        for step, (got, want) in enumerate(zip(plugin["logits"], stock["logits"])):
            close = 1e-4 if step < FIRST_STEPS else 3e-3
            torch.testing.assert_close(
                torch.tensor(got),
                torch.tensor(want),
                rtol=0,
                atol=close,
                msg=lambda m, where=(rank, step): f"rank, step {where}: {m}",
            )
        assert max(abs(a - b) for a, b in zip(plugin["losses"], stock["losses"])) < 1e-4, rank


def test_training_moves_the_outputs(world: list[dict]) -> None:
    """The comparison above means something: the tables learn (the logits change by far more than the tolerance)."""
    first, last = (torch.tensor(world[0]["table_wise"]["logits"][i]) for i in (0, -1))
    assert float((last - first).abs().max()) > 0.1


def test_ranks_that_profiled_their_own_batches_get_an_error_naming_the_tables(world: list[dict]) -> None:
    """Hot rows that differ between ranks would route ids and gradients by other layouts: a collective
    fails, or, where sizes agree, a rank trains on another's rows. Every rank refuses at sharding time."""
    for rank, results in enumerate(world):
        error = results["own_profile_error"]
        assert error is not None, rank
        assert "['t0', 't1']" in error and "the ranks hold different hot rows" in error and "rank 1:" in error, error
