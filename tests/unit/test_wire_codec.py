"""TorchRec's codecs on the plugin's variable segments (torchrec_het/sharding/common/wire_codec.py)."""

import pytest
import torch
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

from torchrec_het.sharding.common.wire_codec import BAGS, codecs_of, summing_dtype

SPLITS = [5, 40, 0, 33]  # segments by destination, none a whole number of int8 / mx4 blocks but 40 and 0


def _codecs(precision: str):
    kind = CommType(precision)
    return codecs_of(get_qcomm_codecs_registry(QCommsConfig(forward_precision=kind, backward_precision=kind)), BAGS)


@pytest.mark.parametrize("precision,close", [("fp16", 1e-3), ("bf16", 1e-2), ("int8", 3e-2), ("mx4", 1.0)])
def test_segments_round_trip_within_the_codecs_rounding(precision: str, close: float) -> None:
    codec = _codecs(precision).forward
    flat = torch.randn(sum(SPLITS), generator=torch.Generator().manual_seed(0))
    ctx = codec.context()
    payload = codec.encode(flat, SPLITS, ctx)
    wire = codec.wire_splits(SPLITS, ctx)
    assert payload.numel() == sum(wire) and payload.dtype == codec.codec.quantized_dtype
    # every segment is encoded on its own: a receiver decodes them by source with the same splits
    back = codec.decode(payload, SPLITS, ctx)
    assert back.dtype == torch.float32 and back.shape == flat.shape
    assert (back - flat).abs().max() <= close * flat.abs().max()
    assert 0 < (back - flat).abs().max() or precision == "fp16"


def test_no_registry_sends_fp32_as_it_is() -> None:
    codecs = codecs_of(None, BAGS)
    flat = torch.randn(10)
    assert not codecs.active and codecs.name == "fp32"
    assert codecs.forward.encode(flat, [10], None) is flat and codecs.forward.wire_splits([10], None) == [10]
    assert codecs.forward.bytes_per_element() == 4.0


def test_bytes_per_element_and_names() -> None:
    assert _codecs("fp16").name == "fp16/fp16" and _codecs("fp16").forward.bytes_per_element() == 2.0
    assert _codecs("int8").forward.bytes_per_element() == (32 + 8) / 32  # FBGEMM's row: values, scale, bias


def test_replica_syncs_sum_only_in_float_codecs() -> None:
    assert summing_dtype(None) == torch.float32
    bf16 = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16))
    assert summing_dtype(bf16) == torch.bfloat16
    int8 = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.INT8, backward_precision=CommType.INT8))
    assert summing_dtype(int8) == torch.float32  # bytes cannot be summed as sent


def test_a_codecs_cpu_is_measured_once_and_fp32_costs_none() -> None:
    assert codecs_of(None, BAGS).forward.seconds_per_element() == 0.0
    codec = _codecs("fp16").forward
    first = codec.seconds_per_element()
    assert 0 < first < 1e-6 and codec.seconds_per_element() == first  # kept for the process
