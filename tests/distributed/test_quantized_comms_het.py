"""TorchRec's quantized comms reach ``het_cached_row_wise``: with the same ``qcomm_codecs_registry`` on
every sharder, the HET cache (exact settings: ``s_read = s_write = 0``) trains as the same model on
stock ``row_wise`` under the same codecs, within the codecs' rounding, on 2 and 3 ranks, with SGD
and row-wise Adagrad (whose optimizer state travels with the rows, exact), plain and under
``TrainPipelineSparseDist``. Each case also checks that the codecs changed the plugin's
predictions (``codec_effect``). TorchRec's own table set (``ModelParallelTestShared``'s) is used, as
in tests/distributed/test_quantized_comms.py: stock row_wise does not train the plugin's ``bags``
set as the unsharded model even without codecs (measured here: 0.026 on the predictions and, with
row-wise Adagrad, 0.98 on the tables, whatever the codecs).

The codecs take the rows' values (forward) and the gradients pushed (backward); the rest of those
payloads (push counts, ids, update counts, optimizer state) stays bit-exact
(:mod:`torchrec_het.sharding.het_cache.coded_rows`). The bytes: every case also runs without
codecs (against the unsharded model, exactly), and each rank counts what
``torch.distributed.all_to_all_single`` sends to the other ranks while the sharded model trains: the
codecs' run sends the same integer payloads and about half the float bytes.

Rows fetched ahead (a read bound of one step's lag, here ``s_read = 3``: the owners answer in the
input dist) are a stale model by design, so their check compares the model under codecs with the
same stale model in fp32: the same decisions, values within the codecs' rounding, fewer bytes.

Rank body: :func:`run_world` below (the generic
:func:`torchrec_het_testing.equivalence.sharded_vs_unsharded`, with the bytes counted around training).
"""

import functools
import traceback
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import get_unwrapped_module

from torchrec_het.config import CacheSettings
from torchrec_het.sharding.common.wire_codec import BAGS, codecs_of
from torchrec_het.sharding.het_cache.coded_rows import PayloadRows, ValueCodec
from torchrec_het_testing.equivalence import (
    EquivalenceCase,
    case_batches,
    case_profile,
    shard,
    sharded_vs_unsharded,
    train,
)
from torchrec_het_testing.expectations import case_problems
from torchrec_het_testing.settings import qcomms_registry
from torchrec_het_testing.spawn import gloo_rank, results_by_world, write_rank_result
from torchrec_het_testing.weights import relative_error

HET = "het_cached_row_wise"
TABLES = "torchrec"
EXACT_CACHE = CacheSettings(s_read=0, s_write=0, capacity=0.3)
# one step's lag (ws * (s_write + 1) updates) fits this read bound on 2 and 3 ranks: the owners answer ahead
AHEAD_CACHE = CacheSettings(s_read=3, s_write=0, capacity=0.3)
# the codecs' rounding: fp16 values (11 bits) forward, bf16 gradients (8 bits) backward, over 5 steps.
# Measured on 2 and 3 ranks: at most 2.7e-3 (fp16/bf16, row-wise Adagrad's tables) and 1.1e-3 (fp16/fp16)
TOLERANCE = {"fp16/bf16": 1e-2, "fp16/fp16": 5e-3}
# float bytes under fp16/bf16 over those in fp32: 0.52-0.58 measured (the values halve; push counts,
# ids, update counts and row-wise Adagrad's state do not)
FLOAT_BYTES_RATIO = 0.65


def _cases(world_size: int) -> list[EquivalenceCase]:
    ws = {"world_size": world_size}
    out = []
    for optimizer in ("sgd", "rowwise_adagrad"):
        out.append(
            EquivalenceCase(
                TABLES, HET, EXACT_CACHE, optimizer, qcomms="fp16/bf16", tolerance=TOLERANCE["fp16/bf16"], **ws
            )
        )
    out.append(
        EquivalenceCase(
            TABLES, HET, EXACT_CACHE, "rowwise_adagrad", qcomms="fp16/fp16", tolerance=TOLERANCE["fp16/fp16"], **ws
        )
    )
    out.append(
        EquivalenceCase(
            TABLES, HET, EXACT_CACHE, "sgd", "sparse_dist", qcomms="fp16/bf16", tolerance=TOLERANCE["fp16/bf16"], **ws
        )
    )
    return out


CASES = _cases(2) + _cases(3)


def ahead_case(world_size: int) -> EquivalenceCase:
    return EquivalenceCase(
        TABLES, HET, AHEAD_CACHE, "rowwise_adagrad", "sparse_dist", world_size, qcomms="fp16/bf16", tolerance=1e-2
    )


def without_codecs(case: EquivalenceCase) -> EquivalenceCase:
    """The case's twin in fp32 (compared with the unsharded model, exactly)."""
    return replace(case, qcomms=None, tolerance=1e-5)


class SentBytes:
    """Bytes ``torch.distributed.all_to_all_single`` sends from this rank to the others while entered,
    ``float`` and ``int`` payloads apart."""

    def __init__(self) -> None:
        self.sent = {"float": 0, "int": 0}

    @contextmanager
    def counting(self):
        original = dist.all_to_all_single

        @functools.wraps(original)
        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            size, me = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [input.numel() // size] * size
            kind = "float" if input.is_floating_point() else "int"
            self.sent[kind] += sum(n for rank, n in enumerate(splits) if rank != me) * input.element_size()
            return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

        dist.all_to_all_single = counted
        try:
            yield
        finally:
            dist.all_to_all_single = original


def with_bytes(case: EquivalenceCase) -> dict:
    """The case's result, with ``sent``: the bytes its sharded model's all-to-alls sent while training."""
    counter = SentBytes()
    try:
        result = sharded_vs_unsharded(case, torch.device("cpu"), around_training=counter.counting)
    except Exception:  # noqa: BLE001 (recorded for the test to show)
        return {"error": traceback.format_exc()}
    return {**result, "sent": counter.sent}


def fetched_ahead(case: EquivalenceCase) -> dict:
    """The case's sharded model trained under its codecs and in fp32: ``difference`` (the largest
    relative difference of their predictions), ``ahead`` (every HET lookup fetched ahead) and the
    bytes each sent (``sent``, ``sent_fp32``)."""
    device, rank = torch.device("cpu"), dist.get_rank()
    steps = case_batches(case)
    profile, mine = case_profile(case, steps), [s[rank] for s in steps]
    out, predictions = {}, {}
    for key, twin in (("sent", case), ("sent_fp32", without_codecs(case))):
        model, counter = shard(twin, HET, device, profile), SentBytes()
        with counter.counting():
            predictions[key] = train(twin, model, mine, device)
        out[key] = counter.sent
        modules = get_unwrapped_module(model)
        lookups = [lookup for m in (modules.ebc, modules.wbc) for lookup in m.het_lookups()]
        out["ahead"] = bool(lookups) and all(lookup.ahead for lookup in lookups)
    out["difference"] = max(relative_error(c, p) for c, p in zip(predictions["sent"], predictions["sent_fp32"]))
    return out


def run_world(rank: int, world_size: int, port: int, out_dir: str, cases: list[EquivalenceCase]) -> None:
    """Spawn target: every case and its fp32 twin, then the rows fetched ahead, on gloo (CPU);
    writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        out = {}
        for case in cases:
            out[case.name] = with_bytes(case)
            out[without_codecs(case).name] = with_bytes(without_codecs(case))
        try:
            out["fetched_ahead"] = fetched_ahead(ahead_case(world_size))
        except Exception:  # noqa: BLE001 (recorded for the test to show)
            out["fetched_ahead"] = {"error": traceback.format_exc()}
        write_rank_result(out_dir, rank, out)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return results_by_world(tmp_path_factory, run_world, CASES, "qcomms_het")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_het_cache_under_codecs_trains_as_stock_row_wise_under_them(worlds, case: EquivalenceCase) -> None:
    problems = case_problems(case, worlds(case.world_size)[case.name])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES, ids=[without_codecs(c).name for c in CASES])
def test_without_codecs_it_trains_as_the_unsharded_model(worlds, case: EquivalenceCase) -> None:
    twin = without_codecs(case)
    problems = case_problems(twin, worlds(case.world_size)[twin.name])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_codecs_send_fewer_bytes(worlds, case: EquivalenceCase) -> None:
    """The same integer payloads; the float ones (rows and pushes) clearly smaller: their values
    travel in two bytes instead of four, the rest (headers, ids, optimizer state) as it was."""
    coded = worlds(case.world_size)[case.name]
    plain = worlds(case.world_size)[without_codecs(case).name]
    for rank, (c, p) in enumerate(zip(coded, plain)):
        assert "error" not in c and "error" not in p, (c.get("error"), p.get("error"))
        assert c["sent"]["int"] == p["sent"]["int"], (rank, c["sent"], p["sent"])
        assert 0 < c["sent"]["float"] < FLOAT_BYTES_RATIO * p["sent"]["float"], (rank, c["sent"], p["sent"])


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda ws: f"ws{ws}")
def test_rows_fetched_ahead_take_the_codecs(worlds, world_size: int) -> None:
    """The owners answer in the input dist (``HetRequestsDist.fetch_ahead``): under the codecs the
    same stale model, within their rounding, in fewer bytes."""
    for rank, r in enumerate(worlds(world_size)["fetched_ahead"]):
        assert "error" not in r, r["error"]
        assert r["ahead"], f"rank {rank}: the HET lookups did not fetch ahead"
        assert 0 < r["difference"] <= ahead_case(world_size).tolerance, (rank, r["difference"])
        assert r["sent"]["int"] == r["sent_fp32"]["int"], (rank, r)
        assert 0 < r["sent"]["float"] < FLOAT_BYTES_RATIO * r["sent_fp32"]["float"], (rank, r)


@pytest.mark.parametrize("qcomms", ["fp16/bf16", "int8/int8"])
def test_values_take_the_codec_and_the_rest_arrives_bit_exact(qcomms: str) -> None:
    """One rank's view of a payload of rows of two widths (values, then a state float) after a
    header of two words per rank, as :class:`~torchrec_het.sharding.het_cache.coded_rows.ValueCodec`
    packs and unpacks it; the exact words include bit patterns that are NaN as float32."""
    codec = ValueCodec(codecs_of(qcomms_registry(qcomms), BAGS).forward)
    ranks, widths, values = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([5, 0, 3, 5, 3]), torch.tensor([4, 0, 2, 4, 2])
    heads = 2
    splits = [heads + int(widths[ranks == r].sum()) for r in range(3)]
    counts = [int(values[ranks == r].sum()) for r in range(3)]
    share = PayloadRows(widths, values, ranks).share(splits, counts, heads)
    flat = torch.randn(sum(splits))
    exact = torch.ones(flat.numel(), dtype=torch.bool).index_fill_(0, share.positions, False)
    flat[exact.nonzero()[:2].flatten()] = torch.tensor([-1, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    ctx = codec.context()
    sent = codec.encode(flat, share, ctx)
    assert sent.dtype == torch.float32 and sent.numel() == sum(codec.wire_splits(share, ctx))
    back = codec.decode(sent, share, ctx)
    assert torch.equal(back[exact].view(torch.int32), flat[exact].view(torch.int32))
    assert 0 < (back[~exact] - flat[~exact]).abs().max() < 0.05
    if qcomms == "fp16/bf16":  # two bytes a value, words padded per rank
        assert codec.wire_splits(share, ctx) == [e + -(-v // 2) for e, v in zip(share.exact, counts)]
