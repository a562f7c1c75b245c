"""TorchRec's quantized comms on the payloads of ``het_cached_row_wise``: values coded, the rest exact.

Both float payloads of the type are rows that mix values with words that must arrive bit-exact:

- the rows an owner sends (forward codec): each row's embedding values, then the optimizer state
  the requester's cache keeps (Adagrad family); in the output dist each rank's segment starts with
  a header of push counts (int32 bit patterns);
- the rows a backward pushes (backward codec, :func:`~torchrec_het.sharding.het_cache.pushes.pack_push`):
  id and update count (int64 bit patterns), the gradient, then the Adagrad family's squares beyond.

Only the embedding values and the gradients take the codec (TorchRec's codec objects, through
:class:`~torchrec_het.sharding.common.wire_codec.WireCodec`).

Design: each payload keeps its one float32 all-to-all. Under a codec, each rank's segment becomes
its exact words, in their order, then the codec's encoding of its values, whose bytes are packed
into float32 words (the last one padded with zeros). A word then carries two fp16 or bf16 values,
or four bytes of int8 or mx4, as it already carries ids: as bits, which an all-to-all never reads.
The receiver cuts each source's segment in two, decodes the values and puts both back where the
payload's layout had them, so the lookup and the pushes read the layout they read without a codec.
The alternatives were worse: a collective per dtype doubles the exchanges of a step, and one
tensor cannot mix dtypes. As in TorchRec's all-to-all and the plugin's other exchanges, every
segment is coded, a rank's own included. Without a codec none of this runs: payloads and bytes are
unchanged.

Design: docs/internals.md#het-cache-dists
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchrec_het.sharding.common.wire_codec import WireCodec

WORD = 4  # bytes of a float32 word


def run_positions(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Positions ``starts[i] + [0, lengths[i])`` of every run, in order (``count`` in all: no host sync)."""
    firsts = torch.cumsum(lengths, 0) - lengths  # where each run starts among the positions
    shift = torch.repeat_interleave(starts - firsts, lengths, output_size=count)
    return torch.arange(count, device=starts.device) + shift


def row_values(
    widths: torch.Tensor, values: torch.Tensor, count: int, first: int = 0, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions of the values in a flat payload of rows: row i is ``widths[i]`` floats (0: not in
    the payload), ``values[i]`` of them values from its ``first``; ``shift[i]``: words before the
    row that are not rows (headers); ``count``: values in all."""
    starts = torch.cumsum(widths, 0) - widths + first
    if shift is not None:
        starts = starts + shift
    return run_positions(starts, values, count)


def _others(positions: torch.Tensor, total: int) -> torch.Tensor:
    """The positions of ``[0, total)`` not in ``positions``, ascending (no host sync)."""
    count = total - positions.numel()
    kept = torch.ones(total, dtype=torch.bool, device=positions.device).index_fill_(0, positions, False)
    slot = torch.where(kept, torch.cumsum(kept, 0) - 1, count)  # the others' ranks; the rest go to a spare slot
    out = torch.empty(count + 1, dtype=torch.int64, device=positions.device)
    return out.scatter_(0, slot, torch.arange(total, device=positions.device))[:count]


@dataclass
class ValueShare:
    """One side's payload (segments by rank) and the values in it that the codec takes.

    Attributes:
        splits: floats of each rank's segment.
        values: values among them, per rank.
        positions: the values' positions in the payload, ascending.
    """

    splits: list[int]
    values: list[int]
    positions: torch.Tensor

    @property
    def exact(self) -> list[int]:
        """Words of each rank's segment sent as they are."""
        return [n - v for n, v in zip(self.splits, self.values)]


class ValueCodec:
    """One direction's codec on the values of a mixed payload (module docstring).

    Args:
        codec: the direction's :class:`~torchrec_het.sharding.common.wire_codec.WireCodec`.
        scale: a factor the sender applied to the values (TorchRec's gradient division): they
            travel without it and take it back on arrival, as in TorchRec's all-to-all.
    """

    def __init__(self, codec: WireCodec, scale: float = 1.0) -> None:
        self.codec, self.scale = codec, scale

    @property
    def active(self) -> bool:
        return self.codec.active

    def context(self):
        return self.codec.context()

    def _coded_bytes(self, share: ValueShare, ctx) -> list[int]:
        itemsize = torch.empty(0, dtype=self.codec.codec.quantized_dtype).element_size()
        return [n * itemsize for n in self.codec.wire_splits(share.values, ctx)]

    def wire_splits(self, share: ValueShare, ctx) -> list[int]:
        """Float32 words of each rank's segment on the wire."""
        return [e + -(-b // WORD) for e, b in zip(share.exact, self._coded_bytes(share, ctx))]

    def encode(self, flat: torch.Tensor, share: ValueShare, ctx) -> torch.Tensor:
        """``flat`` (float32, laid out as ``share`` says) as sent: per rank, exact words then coded values."""
        values = flat.index_select(0, share.positions)
        if self.scale != 1.0:
            values = values / self.scale
        coded = self.codec.encode(values, share.values, ctx).reshape(-1).view(torch.uint8)
        exact = flat.index_select(0, _others(share.positions, flat.numel())).view(torch.uint8)
        pieces = []
        for words, code in zip(
            exact.split([WORD * n for n in share.exact]), coded.split(self._coded_bytes(share, ctx))
        ):
            pieces += [words, F.pad(code, (0, -code.numel() % WORD))]
        return torch.cat(pieces).view(torch.float32)

    def decode(self, received: torch.Tensor, share: ValueShare, ctx) -> torch.Tensor:
        """What arrived (segments of :meth:`wire_splits` words by source) back in ``share``'s layout, float32."""
        coded_bytes = self._coded_bytes(share, ctx)
        cuts = [c for e, b in zip(share.exact, coded_bytes) for c in (WORD * e, WORD * -(-b // WORD))]
        parts = received.contiguous().view(torch.uint8).split(cuts)
        exact = torch.cat(parts[0::2]).view(torch.float32)
        coded = torch.cat([p[:b] for p, b in zip(parts[1::2], coded_bytes)]).view(self.codec.codec.quantized_dtype)
        values = self.codec.decode(coded, share.values, ctx)
        if self.scale != 1.0:
            values = values * self.scale
        out = torch.empty(sum(share.splits), device=received.device)
        out.index_copy_(0, share.positions, values)
        return out.index_copy_(0, _others(share.positions, out.numel()), exact)


@dataclass
class CodedPayload:
    """A payload's codec and where its values sit on both sides of its all-to-all."""

    codec: ValueCodec
    out: ValueShare  # what this rank sends, by destination
    into: ValueShare  # what it receives, by source


@dataclass
class PayloadRows:
    """The rows of one side's payload, in order: each row's floats (0: not in the payload), how many
    of them are values (the codec's share) and (where asked for) the rank it goes to or comes from."""

    widths: torch.Tensor
    values: torch.Tensor
    ranks: torch.Tensor | None = None

    def values_per_rank(self, world_size: int) -> torch.Tensor:
        return torch.bincount(self.ranks, self.values, minlength=world_size).long()

    def share(self, splits: list[int], values: list[int], heads: int = 0, first: int = 0) -> ValueShare:
        """The payload's :class:`ValueShare` (``splits`` floats and ``values`` values per rank): each
        rank's segment starts with ``heads`` header words, each row's values at its float ``first``."""
        shift = heads * (self.ranks + 1) if heads else None
        return ValueShare(splits, values, row_values(self.widths, self.values, sum(values), first, shift))
