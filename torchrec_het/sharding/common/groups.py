"""The process groups of the plugin's own traffic, beside the sharding's."""

import torch.distributed as dist

from torchrec_het._compat import process_group_timeout


def dedicated_group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group of ``pg``'s ranks, with its backend and timeout (the parent's, not the backend's
    default), for the plugin's exchanges or replica syncs: on a group of their own they neither
    wait behind nor hold up the model's other collectives (DDP's dense all-reduce) on ``pg``.
    Every rank of ``pg`` calls it, in the same order."""
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size(pg)))
    return dist.new_group(
        ranks, backend=dist.get_backend(pg), use_local_synchronization=True, timeout=process_group_timeout(pg)
    )
