"""TorchRec's quantized-comms codecs on the plugin's exchanges.

A user turns on quantized communication once, for stock and plugin tables alike: the
``qcomm_codecs_registry`` of the sharder (``get_qcomm_codecs_registry(QCommsConfig(...))``).
TorchRec hands it to every sharding; the plugin's shardings pick the codecs of the collective
they issue (:func:`codecs_of`) and apply them, with the codec objects TorchRec built, to every
float payload that crosses ranks:

- ``het_row_replicated`` bags: the owners' partial sums (forward codec) and their gradients
  (backward codec), keyed ``POOLED_EMBEDDINGS_ALL_TO_ALL`` (they travel by all-to-all);
- ``het_row_replicated`` sequences: the rows sent (forward) and their gradients (backward), keyed
  ``SEQUENCE_EMBEDDINGS_ALL_TO_ALL``;
- ``het_cached_row_wise``: the rows fetched (forward) and the gradients pushed (backward), keyed
  ``POOLED_EMBEDDINGS_ALL_TO_ALL``.

The replica syncs of ``het_row_replicated`` sum hot rows' gradients over ranks (an all-reduce): they
take the backward codec of TorchRec's summing collective (``POOLED_EMBEDDINGS_REDUCE_SCATTER``) when it
is fp16 or bf16, summing in that dtype as TorchRec's quantized reduce-scatter does (:func:`summing_dtype`;
other codecs cannot be summed as sent, and those syncs stay fp32). Ids, counts, versions, optimizer
state and the copies of weights stay as they are.

The plugin's exchanges send variable segments (one per destination), so a codec that quantizes
in blocks (INT8 and FP8 row-wise: ``row_dim``; MX4: its group) gets every segment padded to a
whole number of blocks, as TorchRec pads its sequence all-to-all; the padding is dropped after
decoding.

Design: docs/internals.md#quantized-comms
"""

import time

import torch
import torch.nn.functional as F
from torchrec.distributed.types import CommOp, NoOpQuantizedCommCodec, QuantizedCommCodecs

from torchrec_het._compat import codec_precision, codec_row_dim

BAGS = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
SUMS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
SEQUENCES = CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL

_BLOCKED = {"int8": "row_dim", "fp8": "row_dim", "mx4": "mx_group_size"}  # quantized in blocks of ctx.<attr>
_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "mx4": 0.5}
PROBE_ELEMENTS = 1 << 18  # what the codec CPU probe encodes and decodes (a multiple of every block)
_SECONDS: dict[tuple, float] = {}  # (codec type, precision, block) -> measured seconds per element


def codecs_of(registry: dict | None, comm_op: CommOp) -> "WireCodecs":
    """The codecs the sharder's ``qcomm_codecs_registry`` gives ``comm_op`` (none: fp32 both ways)."""
    codecs = registry.get(comm_op.name) if registry else None
    return WireCodecs(codecs)


def summing_dtype(registry: dict | None) -> torch.dtype:
    """The dtype gradients summed over ranks travel in: the backward codec of TorchRec's summing
    collective (``POOLED_EMBEDDINGS_REDUCE_SCATTER``) when it is fp16 or bf16, else fp32."""
    backward = codecs_of(registry, SUMS).backward
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(backward.name, torch.float32)


class WireCodec:
    """One direction's codec (TorchRec's ``QuantizedCommCodec``, or None: sent as it is).

    :meth:`encode` turns the float segments one rank sends (by destination) into the payload and
    its splits; :meth:`decode` turns what arrived (by source) back into fp32, padding dropped.
    One context serves one exchange on one rank: created per call pair by :meth:`context`.
    """

    def __init__(self, codec=None) -> None:
        self.codec = None if codec is None or isinstance(codec, NoOpQuantizedCommCodec) else codec
        precision = codec_precision(self.codec)  # FBGEMM's codec (TorchRec reads it too)
        self.precision = precision if precision is not None else ("fp32" if self.codec is None else "custom")
        if self.precision == "fp8" and codec_row_dim(self.codec) <= 0:
            self._block_attr = None  # FP8 without a row dim quantizes element by element
        else:
            self._block_attr = _BLOCKED.get(self.precision)

    @property
    def active(self) -> bool:
        return self.codec is not None

    @property
    def name(self) -> str:
        """``fp32`` (no codec), FBGEMM's precision name (``fp16``, ``bf16``, ``int8``, ...) or ``custom``."""
        return self.precision

    def context(self):
        return self.codec.create_context() if self.codec is not None else None

    def block(self, ctx) -> int:
        """Elements per quantization block (1: any length encodes)."""
        return int(getattr(ctx, self._block_attr)) if self._block_attr is not None and ctx is not None else 1

    def padded(self, splits: list[int], ctx) -> list[int]:
        block = self.block(ctx)
        return splits if block == 1 else [-(-n // block) * block for n in splits]

    def wire_splits(self, splits: list[int], ctx) -> list[int]:
        """Elements of each segment on the wire, once encoded (in the payload's dtype)."""
        if self.codec is None:
            return list(splits)
        return [self.codec.calc_quantized_size(n, ctx) for n in self.padded(splits, ctx)]

    def encode(self, flat: torch.Tensor, splits: list[int], ctx) -> torch.Tensor:
        """``flat`` (fp32, segments of ``splits`` elements by destination) as the payload to send."""
        if self.codec is None:
            return flat
        padded = self.padded(splits, ctx)
        if padded != splits:
            flat = torch.cat([F.pad(s, (0, p - n)) for s, n, p in zip(flat.split(splits), splits, padded)])
        if flat.numel() == 0:  # nothing to quantize: an empty payload of the codec's dtype
            self.codec.encode(torch.zeros(self.block(ctx), device=flat.device), ctx)  # sets what decode reads
            return torch.empty(0, dtype=self.codec.quantized_dtype, device=flat.device)
        return self.codec.encode(flat.float().contiguous(), ctx)

    def decode(self, received: torch.Tensor, splits: list[int], ctx) -> torch.Tensor:
        """What arrived (segments of ``splits`` elements before encoding, by source) back in fp32."""
        if self.codec is None:
            return received
        if received.numel() == 0:
            return torch.empty(0, device=received.device)
        values = self.codec.decode(received, ctx).float()
        padded = self.padded(splits, ctx)
        if padded != splits:
            values = torch.cat([s[:n] for s, n in zip(values.split(padded), splits)])
        return values

    def bytes_per_element(self, ctx=None) -> float:
        """Wire bytes per fp32 element (block scales included; the planner's figure)."""
        if self.codec is None:
            return 4.0
        if self.precision == "int8" or (self.precision == "fp8" and self._block_attr is not None):
            row = self.block(ctx if ctx is not None else self.context())
            return ((row + 3) // 4 * 4 + 8) / row  # FBGEMM's row: the values, then scale and bias
        if self.precision == "mx4":
            group = self.block(ctx if ctx is not None else self.context())
            return 0.5 + 1.0 / group  # two values a byte, one shared exponent a group
        return _BYTES.get(self.precision, 4.0)

    def seconds_per_element(self) -> float:
        """CPU seconds to encode one fp32 element and decode it again (0: no codec); measured once per
        process and codec kind: the fastest of 7 rounds over :data:`PROBE_ELEMENTS` elements (the
        codec's own cost, whatever else the machine runs)."""
        if self.codec is None:
            return 0.0
        ctx = self.context()
        key = (type(self.codec).__name__, self.precision, self.block(ctx))
        if key not in _SECONDS:
            values = torch.randn(PROBE_ELEMENTS, generator=torch.Generator().manual_seed(0))
            rounds = []
            for _ in range(2 + 7):  # two warm-ups
                began = time.perf_counter()
                self.decode(self.encode(values, [values.numel()], ctx), [values.numel()], ctx)
                rounds.append(time.perf_counter() - began)
            _SECONDS[key] = min(rounds[2:]) / values.numel()
        return _SECONDS[key]


class WireCodecs:
    """The forward and backward codecs of one collective (fp32 both ways when ``codecs`` is None)."""

    def __init__(self, codecs: QuantizedCommCodecs | None = None) -> None:
        self.forward = WireCodec(codecs.forward if codecs is not None else None)
        self.backward = WireCodec(codecs.backward if codecs is not None else None)

    @property
    def active(self) -> bool:
        return self.forward.active or self.backward.active

    @property
    def name(self) -> str:
        """``fp32``, or ``<forward>/<backward>`` (``fp16/bf16``)."""
        return f"{self.forward.name}/{self.backward.name}" if self.active else "fp32"
