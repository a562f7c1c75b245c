"""What both plugin types take from TorchRec's row-wise sharding: a staged sharding base and the plan generator.

Both types keep TorchRec's row-wise shards (sizes, offsets, fused kernels, state dict and fused
optimizer are row-wise's own) and add their own input dist, lookup and output dist.
"""

from typing import Any

from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import ParameterSharding

from torchrec_het._compat import sharding_lookup_arguments
from torchrec_het.plan_options import check_options, options_of, with_options


class StagedSharding:
    """Mixin for a TorchRec row-wise sharding whose dists share its one lookup (``lookup_class``).

    Args (before the row-wise sharding's own): sharding_infos, env, then ``hot_rows`` (this rank's hot
    row ids of ``het_row_replicated`` tables, name -> (replicated, per_host); None for other types), and device. Every
    table's settings come from its plan entry's options
    (:class:`~torchrec_het.plan_options.HetParameterSharding`): :meth:`lookup_config` turns them into
    what the lookup runs with.

    The sharding builds the lookup once (TorchRec asks for lookups before output dists and input
    dists last); the type's ``create_input_dist`` / ``create_output_dist`` hand it to its dists.
    Subclasses set ``lookup_class`` and ``sharding_type``.
    """

    lookup_class: type
    sharding_type: str

    def __init__(self, sharding_infos, env, hot_rows=None, device=None, **kwargs) -> None:
        super().__init__(sharding_infos, env, device, **kwargs)
        self.options_by_table = plan_options_by_table(sharding_infos, self.sharding_type)
        self._config = self.lookup_config(self.options_by_table, hot_rows)
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }
        self._lookup = None

    def lookup_config(self, options_by_table: dict, hot_rows) -> object:
        """What the lookup is built with (its ``config``), from the plan's options of these tables."""
        raise NotImplementedError

    def set_training(self, training: bool) -> None:
        """The sharded module's mode, before each input dist (its dists are not submodules)."""

    def lookup_settings(self) -> dict:
        """The lookup's settings arguments (besides TorchRec's): its ``config`` and each table's shards."""
        return {"config": self._config, "shards_by_table": self.shards_by_table}

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise NotImplementedError(f"{self.sharding_type} does not support feature processors")
        if self._lookup is None:
            arguments = sharding_lookup_arguments(self)
            if device is not None:
                arguments["device"] = device
            self._lookup = self.lookup_class(feature_names=self.feature_names(), **self.lookup_settings(), **arguments)
        return self._lookup


def plan_options_by_table(sharding_infos, sharding_type: str) -> dict:
    """Each table's options from its plan entry; ValueError naming the tables whose entry has none."""
    options = {info.embedding_config.name: options_of(info.param_sharding) for info in sharding_infos}
    missing = sorted(name for name, o in options.items() if o is None)
    if missing:
        raise ValueError(
            f"table(s) {missing} are planned {sharding_type} without options in their ParameterSharding: plan "
            "with HetEmbeddingShardingPlanner, shard through the plugin's sharders, or use the generators of "
            "torchrec_het.sharding"
        )
    for name, o in options.items():
        check_options(sharding_type, o, name)
    return options


def row_wise_as(sharding_type: str, compute_kernel: str | None = None, options=None):
    """TorchRec's ``row_wise()`` plan generator, its output marked ``sharding_type`` and carrying
    ``options`` (None: the sharder fills in its own when it shards)."""
    if options is not None:
        check_options(sharding_type, options)
    rows = row_wise(compute_kernel=compute_kernel)

    def generate(*args: Any, **kwargs: Any) -> ParameterSharding:
        sharding = rows(*args, **kwargs)
        sharding.sharding_type = sharding_type
        return sharding if options is None else with_options(sharding, options)

    return generate
