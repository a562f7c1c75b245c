"""Per-collective byte rules: what one rank sends to each peer of its group.

Every function here is pure (no process group needed) and returns a "send
vector": entry ``j`` is the number of bytes this rank sends to the rank with
*group* rank ``j``, its own entry included. The accountant maps group ranks to
global ranks afterwards. The rules:

* ``all_to_all_single``: ``input_split_sizes[j]`` rows of the input (equal
  split of dim 0 when the sizes are omitted) go to rank ``j``.
* ``all_to_all``: ``input_list[j]`` goes to rank ``j``.
* ``reduce_scatter(output, input_list)``: ``input_list[j]`` goes to rank ``j``.
* ``reduce_scatter_tensor(output, input)``: one ``1/group_size`` slice of the
  input goes to each rank.
* ``all_gather`` / ``all_gather_into_tensor``: this rank's tensor goes to every
  rank.
* ``all_reduce`` of ``N`` bytes: counted as the bandwidth-optimal
  reduce-scatter followed by an all-gather. The tensor is cut into
  ``group_size`` element chunks (the first ``numel % group_size`` one element
  longer); chunk ``j`` goes to rank ``j`` in the reduce-scatter and this rank's
  own reduced chunk goes to every rank in the all-gather, so rank ``j``
  receives ``chunk[j] + chunk[self]`` -- ``2N/group_size`` when ``N`` divides
  evenly.
* ``broadcast`` of ``N`` bytes: the source sends ``N`` to every rank (itself
  included, as in ``all_gather``, whose volume is one broadcast per rank);
  the other ranks send nothing.

From a send vector: *payload* is its sum, self entry included; *cross-rank* is
the sum over the other ranks; *inter-host* is the sum over ranks on another
host than the sender.
"""

from collections.abc import Sequence


def split_evenly(total: int, parts: int) -> list[int]:
    """Cuts ``total`` units into ``parts`` near-equal integer pieces, larger ones first.

    Args:
        total: units to share out (elements, rows, bytes).
        parts: number of pieces; at least 1.

    Returns:
        ``parts`` integers summing to ``total`` that differ by at most one.
    """
    base, extra = divmod(total, parts)
    return [base + 1 if j < extra else base for j in range(parts)]


def all_to_all_single_sends(
    rows: int, row_bytes: int, input_split_sizes: Sequence[int] | None, group_size: int
) -> list[int]:
    """Bytes sent to each rank by ``all_to_all_single``.

    Args:
        rows: ``input.size(0)`` (1 for a 0-dim tensor).
        row_bytes: bytes of one row of the input (a slice along dim 0).
        input_split_sizes: rows sent to each rank, or ``None`` for an equal split.
        group_size: ranks in the group.
    """
    splits = split_evenly(rows, group_size) if input_split_sizes is None else list(input_split_sizes)
    return [int(n) * row_bytes for n in splits]


def per_chunk_sends(chunk_bytes: Sequence[int]) -> list[int]:
    """Bytes sent to each rank when chunk ``j`` goes to rank ``j``.

    The rule of ``all_to_all(output_list, input_list)`` and of
    ``reduce_scatter(output, input_list)``.

    Args:
        chunk_bytes: bytes of ``input_list[j]`` for every rank ``j``.
    """
    return [int(n) for n in chunk_bytes]


def reduce_scatter_tensor_sends(numel: int, element_size: int, group_size: int) -> list[int]:
    """Bytes sent to each rank by ``reduce_scatter_tensor``: one slice of the input each.

    Args:
        numel: elements of the input tensor (``group_size`` times the output).
        element_size: bytes per element.
        group_size: ranks in the group.
    """
    return [n * element_size for n in split_evenly(numel, group_size)]


def all_gather_sends(tensor_bytes: int, group_size: int) -> list[int]:
    """Bytes sent to each rank by ``all_gather``: this rank's tensor to everyone.

    Args:
        tensor_bytes: bytes of this rank's input tensor.
        group_size: ranks in the group.
    """
    return [tensor_bytes] * group_size


def all_reduce_sends(numel: int, element_size: int, group_size: int, group_rank: int) -> list[int]:
    """Bytes sent to each rank by ``all_reduce``, counted as reduce-scatter plus all-gather.

    Args:
        numel: elements of the reduced tensor.
        element_size: bytes per element.
        group_size: ranks in the group.
        group_rank: this rank's index in the group.
    """
    chunks = [n * element_size for n in split_evenly(numel, group_size)]
    own = chunks[group_rank]
    return [chunk + own for chunk in chunks]


def broadcast_sends(tensor_bytes: int, group_size: int, group_rank: int, group_src: int) -> list[int]:
    """Bytes sent to each rank by ``broadcast``: everything from the source, nothing from the rest.

    Args:
        tensor_bytes: bytes of the broadcast tensor.
        group_size: ranks in the group.
        group_rank: this rank's index in the group.
        group_src: the source's index in the group.
    """
    return [tensor_bytes if group_rank == group_src else 0] * group_size


def payload(sends: Sequence[int]) -> int:
    """All bytes of a send vector, the sender's own entry included."""
    return sum(sends)


def cross_rank(sends: Sequence[int], sender: int) -> int:
    """Bytes of a send vector that leave the sender (its own entry excluded).

    Args:
        sends: bytes per destination rank.
        sender: index of the sending rank in ``sends``.
    """
    return sum(n for j, n in enumerate(sends) if j != sender)


def inter_host(sends: Sequence[int], sender: int, host_of_rank: Sequence[int]) -> int:
    """Bytes of a send vector that go to a rank on another host than the sender.

    Args:
        sends: bytes per destination rank.
        sender: index of the sending rank in ``sends``.
        host_of_rank: host id of every rank, indexed like ``sends``.
    """
    return sum(n for j, n in enumerate(sends) if host_of_rank[j] != host_of_rank[sender])
