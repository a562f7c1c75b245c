"""TorchRec's quantized comms reach the plugin's tables: with the same ``qcomm_codecs_registry``
(``get_qcomm_codecs_registry(QCommsConfig(...))``) on every sharder, a plugin-sharded model trains
as the same model on stock ``row_wise`` under the same codecs, within the codecs' rounding, on 2
and 3 ranks, with the fused optimizers users use and TorchRec's awkward cases (the tables of
TorchRec's own ``ModelParallelTestShared``: shared features, weighted tables, mixed widths, and
with mean pooling; sequences). Each case also checks that the codecs changed the plugin's
predictions (``codec_effect``: ignored codecs would leave them exact).

The reference is stock ``row_wise`` under the same codecs; the ``bags`` table set is left out
because stock ``row_wise`` does not train it as the unsharded model even without codecs (0.026
relative on the predictions, measured: a table fed by a feature shared with another table).

Rank body: :func:`torchrec_het_testing.equivalence.sharded_vs_unsharded` with ``qcomms``; the
bytes a codec saves: tests/distributed/test_comm_accounting.py.
"""

import pytest

from torchrec_het_testing.equivalence import EquivalenceCase, run_world
from torchrec_het_testing.expectations import case_problems
from torchrec_het_testing.settings import ReplicaSettings
from torchrec_het_testing.spawn import results_by_world

REP = "het_row_replicated"
# the codecs' rounding: fp16 values (11 bits) forward, bf16 gradients (8 bits) backward, over 5 steps
TOLERANCE = {"fp16/bf16": 2e-2, "fp16/fp16": 5e-3}


def _cases(world_size: int) -> list[EquivalenceCase]:
    ws = {"world_size": world_size}
    out = []
    for qcomms, tolerance in TOLERANCE.items():
        codec = {"qcomms": qcomms, "tolerance": tolerance, **ws}
        out.append(EquivalenceCase("torchrec", REP, ReplicaSettings(hot=4), "rowwise_adagrad", **codec))
        out.append(EquivalenceCase("sequences", REP, ReplicaSettings(hot=4), "adagrad", **codec))
    mixed = {"qcomms": "fp16/bf16", "tolerance": TOLERANCE["fp16/bf16"], **ws}
    out.append(EquivalenceCase("torchrec_mean", REP, ReplicaSettings(hot=4), "sgd", "sparse_dist", **mixed))
    out.append(EquivalenceCase("torchrec", REP, ReplicaSettings(hot=0), "adagrad", **mixed))
    return out


CASES = _cases(2) + _cases(3)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return results_by_world(tmp_path_factory, run_world, CASES, "qcomms")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plugin_under_codecs_trains_as_stock_row_wise_under_them(worlds, case: EquivalenceCase) -> None:
    problems = case_problems(case, worlds(case.world_size)[case.name])
    assert not problems, "\n".join(problems)


def test_the_differences_are_the_codecs_rounding(worlds) -> None:
    """Within the rounding, and not zero: the codecs ran on the plugin's traffic."""
    for world_size in (2, 3):
        for name, ranks in worlds(world_size).items():
            effect = max(r["codec_effect"] for r in ranks if "error" not in r)
            assert 0 < effect, name
