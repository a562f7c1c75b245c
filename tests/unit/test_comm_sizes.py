"""Byte rules of each collective, the totals built from them, and the phase rules, without a process group."""

import pytest
import torch

from torchrec_het_bench.comm import CommTotals, phase, sizes, sum_totals
from torchrec_het_bench.comm.phases import classify


def test_split_evenly_puts_the_remainder_first() -> None:
    assert sizes.split_evenly(10, 3) == [4, 3, 3]
    assert sizes.split_evenly(12, 3) == [4, 4, 4]
    assert sizes.split_evenly(2, 3) == [1, 1, 0]


def test_all_to_all_single_uneven_splits_on_three_ranks() -> None:
    # A (10, 4) float32 input: 16-byte rows; 5, 2 and 3 rows to ranks 0, 1, 2.
    sends = sizes.all_to_all_single_sends(rows=10, row_bytes=16, input_split_sizes=[5, 2, 3], group_size=3)
    assert sends == [80, 32, 48]
    assert sizes.payload(sends) == 160
    assert sizes.cross_rank(sends, sender=1) == 80 + 48  # its own 2 rows stay
    assert sizes.cross_rank(sends, sender=0) == 32 + 48


def test_all_to_all_single_without_splits_divides_rows_equally() -> None:
    # 6 int64 ids to 3 ranks: two each.
    assert sizes.all_to_all_single_sends(rows=6, row_bytes=8, input_split_sizes=None, group_size=3) == [16, 16, 16]


def test_all_to_all_and_reduce_scatter_lists_send_chunk_j_to_rank_j() -> None:
    # reduce_scatter(output, [1, 0 and 6 float32]) / all_to_all(_, same list)
    sends = sizes.per_chunk_sends([4, 0, 24])
    assert sends == [4, 0, 24]
    assert sizes.cross_rank(sends, sender=2) == 4
    assert sizes.cross_rank(sends, sender=0) == 24


def test_reduce_scatter_tensor_sends_one_slice_to_each_rank() -> None:
    # input of 3 x 4 float32 reduce-scattered over 3 ranks: 4 floats to each.
    sends = sizes.reduce_scatter_tensor_sends(numel=12, element_size=4, group_size=3)
    assert sends == [16, 16, 16]
    assert sizes.cross_rank(sends, sender=0) == 32


def test_all_gather_sends_own_tensor_to_everyone() -> None:
    sends = sizes.all_gather_sends(tensor_bytes=20, group_size=3)
    assert sends == [20, 20, 20]
    assert (sizes.payload(sends), sizes.cross_rank(sends, sender=2)) == (60, 40)


def test_all_reduce_is_reduce_scatter_then_all_gather() -> None:
    # 12 float32 = 48 bytes over 3 ranks: 16 bytes to each peer twice.
    sends = sizes.all_reduce_sends(numel=12, element_size=4, group_size=3, group_rank=0)
    assert sends == [32, 32, 32]
    assert sizes.cross_rank(sends, sender=0) == 2 * 48 * 2 // 3  # 2N(ws-1)/ws
    assert sizes.payload(sends) == 2 * 48


def test_all_reduce_uneven_chunks_stay_exact() -> None:
    # 10 float32 over 3 ranks: chunks of 4, 3, 3 floats (16, 12, 12 bytes).
    assert sizes.all_reduce_sends(10, 4, 3, group_rank=0) == [32, 28, 28]
    assert sizes.all_reduce_sends(10, 4, 3, group_rank=2) == [28, 24, 24]
    # Over all ranks: each sends its whole tensor in the reduce-scatter (3 x 40) and
    # every reduced chunk goes to all 3 ranks in the all-gather (3 x 40).
    total = sum(sizes.payload(sizes.all_reduce_sends(10, 4, 3, r)) for r in range(3))
    assert total == 3 * 40 + 3 * 40


def test_broadcast_only_the_source_sends() -> None:
    assert sizes.broadcast_sends(tensor_bytes=40, group_size=3, group_rank=1, group_src=1) == [40, 40, 40]
    assert sizes.broadcast_sends(tensor_bytes=40, group_size=3, group_rank=0, group_src=1) == [0, 0, 0]
    assert sizes.cross_rank([40, 40, 40], sender=1) == 80


def test_inter_host_counts_only_other_hosts() -> None:
    sends = [10, 20, 30, 40]
    hosts = [0, 0, 1, 1]
    assert sizes.inter_host(sends, sender=1, host_of_rank=hosts) == 70
    assert sizes.inter_host(sends, sender=2, host_of_rank=hosts) == 30
    assert sizes.cross_rank(sends, sender=1) == 80


# --- CommTotals ---------------------------------------------------------------------------


def _two_ranks_on_two_hosts() -> tuple[CommTotals, CommTotals]:
    rank0, rank1 = CommTotals(world_size=4), CommTotals(world_size=4)
    rank0.add_sends("fwd_ids", "all_to_all", sender=0, sends=[8, 8, 8, 8])
    rank0.add_sends("dense_allreduce", "all_reduce", sender=0, sends=[2, 2, 2, 2])
    rank1.add_sends("fwd_emb", "reduce_scatter", sender=1, sends=[16, 16, 16, 16])
    rank1.add_sends("other", "broadcast", sender=1, sends=[4, 4, 4, 4])
    return rank0, rank1


def test_totals_derive_payload_cross_rank_and_inter_host_from_one_matrix() -> None:
    rank0, rank1 = _two_ranks_on_two_hosts()
    both = sum_totals([rank0, rank1])
    assert both.payload() == 32 + 8 + 64 + 16
    assert both.cross_rank() == 24 + 6 + 48 + 12
    assert both.cross_rank("fwd_ids") == 24
    assert both.inter_host([0, 0, 1, 1]) == 16 + 4 + 32 + 8  # ranks 2 and 3 are on the other host
    assert both.inter_host([0, 0, 1, 1], phases="fwd_emb") == 32
    assert both.per_peer("fwd_emb") == [16, 16, 16, 16]
    assert rank0.per_peer() == [10, 10, 10, 10]
    assert both.call_count() == 4 and both.call_count(["fwd_ids", "other"]) == 2


def test_summary_has_the_benchmark_shape_and_nothing_hides_in_other() -> None:
    both = sum_totals(_two_ranks_on_two_hosts())
    summary = both.summary(host_of_rank=[0, 0, 1, 1])
    assert summary["phases"] == {
        "fwd_ids": 24,
        "fwd_emb": 48,
        "bwd_grad": 0,
        "dense_allreduce": 6,
        "other": 12,
        "embedding_total": 32 + 64 + 16,
        "embedding_cross_rank": 24 + 48 + 12,
    }
    assert summary["payload"]["dense_allreduce"] == 8
    assert summary["calls"] == {"fwd_ids": 1, "fwd_emb": 1, "bwd_grad": 0, "dense_allreduce": 1, "other": 1}
    assert summary["by_collective"] == {
        "all_to_all": 24,
        "reduce_scatter": 48,
        "all_gather": 0,
        "all_reduce": 0,  # the dense all-reduce is not embedding traffic
        "broadcast": 12,
    }
    assert summary["inter_host"] == 60
    assert both.summary()["inter_host"] is None


def test_totals_round_trip_through_a_dense_tensor() -> None:
    both = sum_totals(_two_ranks_on_two_hosts())
    again = CommTotals.from_tensor(4, both.as_tensor())
    assert again == both


def test_totals_reject_unknown_phases_and_mismatched_worlds() -> None:
    with pytest.raises(ValueError, match="unknown phase"):
        CommTotals(2).payload("embeddings")
    with pytest.raises(ValueError, match="world sizes"):
        CommTotals(2) + CommTotals(3)
    with pytest.raises(ValueError, match="host_of_rank"):
        CommTotals(2).inter_host([0, 0, 1])


# --- phase rules ----------------------------------------------------------------------------


class _ClassifyInBackward(torch.autograd.Function):
    seen: list[str] = []

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _ClassifyInBackward.seen.append(classify(grad.dtype))
        return grad


def input_dist() -> str:
    return classify(torch.float32)


def test_classify_by_dtype_override_backward_and_input_dist() -> None:
    assert classify(torch.int64) == "fwd_ids"
    assert classify(torch.float16) == "fwd_emb"
    assert classify(torch.uint8) == "fwd_emb"  # an int8 / mx4 codec's payload
    with phase("other"):
        assert classify(torch.float32) == "other"
        with phase("dense_allreduce"):
            assert classify(torch.int32) == "dense_allreduce"
    assert input_dist() == "fwd_ids"
    _ClassifyInBackward.seen.clear()
    _ClassifyInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert _ClassifyInBackward.seen == ["bwd_grad"]
    with pytest.raises(ValueError, match="unknown phase"):
        with phase("embeddings"):
            pass
