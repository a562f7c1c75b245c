"""What both plugin sharders add to TorchRec's: the module type they shard, chosen at construction,
and the plugin's sharding types on TorchRec's fused row-wise kernel."""

from typing import Any

from torchrec.distributed.types import ShardingType


class PluginSharder:
    """Mixin placed before a TorchRec sharder in the bases.

    Subclasses set ``plugin_types`` (the plugin's sharding types they offer) and
    ``module_base`` (the TorchRec module class every ``module_type`` must derive from).
    """

    plugin_types: tuple[str, ...] = ()
    module_base: type = object

    def _set_module_type(self, module_type: Any) -> None:
        if not (isinstance(module_type, type) and issubclass(module_type, self.module_base)):
            name = self.module_base.__name__
            raise ValueError(f"module_type must be {name} or a subclass, got {module_type!r}")
        self._module_type = module_type

    @property
    def module_type(self) -> type:
        return self._module_type

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type in self.plugin_types:  # row-wise shards on the fused kernel
            return super().compute_kernels(ShardingType.ROW_WISE.value, compute_device_type)[:1]
        return super().compute_kernels(sharding_type, compute_device_type)
