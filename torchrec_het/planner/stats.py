"""``EmbeddingStats`` that can print the plugin's sharding types.

TorchRec's stats table abbreviates sharding types through a private lookup that rejects
types it does not know; :class:`HetEmbeddingStats` extends that lookup for the duration of
its own ``log`` call only (restored afterwards, also on error) and adds a legend, each plugin
table's plan options and, from
:class:`~torchrec_het.planner.HetEmbeddingShardingPlanner`, the link figures it priced. Input
and output sizes of a plugin option are shown as those of its row_wise twin.
"""

import logging

from torchrec.distributed.planner.stats import logger  # the legend goes where TorchRec's table goes

from torchrec_het import _compat
from torchrec_het.plan_options import describe
from torchrec_het.planner.estimators import as_row_wise
from torchrec_het.planner.pricing import priced_options
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

ABBREVIATIONS = {HET_CACHED_ROW_WISE: "HC", HET_ROW_REPLICATED: "HR"}


def shown(log: logging.Logger, level: int) -> bool:
    """Whether ``log``'s records of ``level`` reach a handler other than a NullHandler that emits them
    (up the parents while they propagate; ``logging.lastResort`` aside): where none does, the plugin
    says its line on stderr itself."""
    if not log.isEnabledFor(level):
        return False
    current: logging.Logger | None = log
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and level >= h.level for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def sharding_type_abbreviation(sharding_type: str) -> str:
    """The stats table's short name of a sharding type, the plugin's included."""
    return ABBREVIATIONS.get(sharding_type) or _compat.stock_sharding_type_abbreviation(sharding_type)


class HetEmbeddingStats(_compat.EmbeddingStatsWithShardOption):
    """TorchRec's planner stats table, with ``HC`` (het_cached_row_wise) and ``HR`` (het_row_replicated)."""

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans, run_time,
            best_plan, constraints=None, sharders=None, enumerator=None, debug=True, debug_stats=None) -> None:  # fmt: skip
        with _compat.sharding_type_abbreviations(sharding_type_abbreviation):
            super().log(
                sharding_plan,
                topology,
                batch_size,
                storage_reservation,
                num_proposals,
                num_plans,
                run_time,
                best_plan,
                constraints,
                sharders,
                enumerator,
                debug,
                debug_stats,
            )
        used = sorted({o.sharding_type for o in best_plan} & set(ABBREVIATIONS))
        if used:
            logger.info("torchrec_het sharding types: %s", ", ".join(f"{ABBREVIATIONS[t]} = {t}" for t in used))
        for option in best_plan:
            if option.sharding_type in ABBREVIATIONS:
                text = describe(priced_options(option))
                logger.info("torchrec_het options: %s %s: %s", option.fqn, ABBREVIATIONS[option.sharding_type], text)
        figures = getattr(topology.comms_bandwidths, "figures", None)  # HetCommsBandwidths: the planner's
        if figures is not None:
            logger.info("torchrec_het %s", figures.describe())

    def shard_stats_option(self, sharding_option):
        """A plugin option's shard stats (input and output sizes) are those of its row_wise twin."""
        if sharding_option.sharding_type in ABBREVIATIONS:
            return as_row_wise(sharding_option)
        return sharding_option
