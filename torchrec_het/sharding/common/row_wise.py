"""What both plugin types take from TorchRec's row-wise sharding: a staged sharding base and the plan generator.

Both types keep TorchRec's row-wise shards (sizes, offsets, fused kernels, state dict and fused
optimizer are row-wise's own) and add their own input dist, lookup and output dist.
"""

from typing import Any

from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import ParameterSharding

from torchrec_het._compat import sharding_lookup_arguments


class StagedSharding:
    """Mixin for a TorchRec row-wise sharding whose dists share its one lookup (``lookup_class``).

    Args (before the row-wise sharding's own): sharding_infos, env, then ``config``, the type's
    settings for these tables, and device.

    The sharding builds the lookup once (TorchRec asks for lookups before output dists and input
    dists last); the type's ``create_input_dist`` / ``create_output_dist`` hand it to its dists.
    Subclasses set ``lookup_class`` and ``sharding_type``.
    """

    lookup_class: type
    sharding_type: str

    def __init__(self, sharding_infos, env, config, device=None, **kwargs) -> None:
        super().__init__(sharding_infos, env, device, **kwargs)
        self._config = config
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }
        self._lookup = None

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise NotImplementedError(f"{self.sharding_type} does not support feature processors")
        if self._lookup is None:
            arguments = sharding_lookup_arguments(self)
            if device is not None:
                arguments["device"] = device
            self._lookup = self.lookup_class(
                feature_names=self.feature_names(), config=self._config, shards_by_table=self.shards_by_table, **arguments
            )
        return self._lookup


def row_wise_as(sharding_type: str, compute_kernel: str | None = None):
    """TorchRec's ``row_wise()`` plan generator, its output marked ``sharding_type``."""
    rows = row_wise(compute_kernel=compute_kernel)

    def generate(*args: Any, **kwargs: Any) -> ParameterSharding:
        sharding = rows(*args, **kwargs)
        sharding.sharding_type = sharding_type
        return sharding

    return generate
