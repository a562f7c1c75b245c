"""How the plugin's sharded modules hand each plugin sharding its per-batch context.

:class:`PluginContexts`, placed before TorchRec's sharded EBC / EC in the bases, changes two
things for the plugin's shardings only: after ``input_dist`` their entries of
``ctx.sharding_contexts`` become :class:`~torchrec_het.sharding.common.context.HetShardingContext`
holding the planned batch, and TorchRec's loops call their lookups ``lookup(features,
sharding_ctx)``. Stock shardings run as TorchRec runs them.

Design: docs/internals.md#sharding-context
"""

from torchrec_het._compat import (
    input_dist_awaitables,
    lookups_called_with,
    sharded_embedding_shardings,
    sharded_lookups,
)
from torchrec_het.sharding.common.context import ContextBoundLookup, HetShardingContext, het_sharding_context
from torchrec_het.sharding.common.row_wise import StagedSharding


class PluginContexts:
    """Mixin of the plugin's sharded modules; call :meth:`find_plugin_shardings` at the end of ``__init__``."""

    def find_plugin_shardings(self) -> None:
        """Notes which shardings are the plugin's (their index in TorchRec's per-sharding lists)."""
        self._plugin_shardings = [
            i for i, sharding in enumerate(sharded_embedding_shardings(self)) if isinstance(sharding, StagedSharding)
        ]

    def input_dist(self, ctx, features):
        shardings = sharded_embedding_shardings(self)
        for i in self._plugin_shardings:  # TorchRec's input dists are not submodules: they learn the mode here
            shardings[i].set_training(self.training)
        splits = super().input_dist(ctx, features)  # one sharding context per sharding, in order
        if self._plugin_shardings:
            awaitables = input_dist_awaitables(splits)
            for i in self._plugin_shardings:
                ctx.sharding_contexts[i] = het_sharding_context(
                    ctx.sharding_contexts[i], awaitables[i].batch, self.training
                )
        return splits

    def compute(self, ctx, dist_input):
        with lookups_called_with(self, self._bound_lookups(ctx)):
            return super().compute(ctx, dist_input)

    def compute_and_output_dist(self, ctx, input):  # noqa: A002 (TorchRec's name)
        with lookups_called_with(self, self._bound_lookups(ctx)):
            return super().compute_and_output_dist(ctx, input)

    def prefetch(self, dist_input, forward_stream=None, ctx=None) -> None:
        with lookups_called_with(self, self._bound_lookups(ctx) if ctx is not None else {}):
            super().prefetch(dist_input, forward_stream, ctx)

    def _bound_lookups(self, ctx) -> dict[int, ContextBoundLookup]:
        """Each plugin lookup bound to this batch's sharding context."""
        lookups, bound = sharded_lookups(self), {}
        for i in self._plugin_shardings:
            sharding_ctx = ctx.sharding_contexts[i]
            if not isinstance(sharding_ctx, HetShardingContext):
                raise RuntimeError(
                    f"{type(self).__name__}: the context of this batch did not come from this module's input_dist "
                    f"(sharding {i} has a {type(sharding_ctx).__name__}); call input_dist(ctx, features) first"
                )
            bound[i] = ContextBoundLookup(lookups[i], sharding_ctx)
        return bound
