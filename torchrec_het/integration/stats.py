"""``stats_by_table(model)``: the plugin's counters of every plugin-sharded table of a model, on this rank."""

import torch
from torchrec.distributed.model_parallel import get_unwrapped_module

from torchrec_het.integration.plan_check import watch_of
from torchrec_het.sharders import HetShardedEmbeddingBagCollection, HetShardedEmbeddingCollection
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED


def stats_by_table(model: torch.nn.Module) -> dict[str, dict]:
    """The counters of every table planned ``het_cached_row_wise`` or ``het_row_replicated`` in
    ``model`` (a ``DistributedModelParallel`` or any module holding the plugin's sharded modules),
    counted on this rank since they were last reset; plain Python numbers only.

    Each table gives ``module`` (its sharded module's name in the unwrapped model), ``sharding_type``
    and either ``cache`` (het_cached_row_wise: lookups, hits and hit rates, requests, rows fetched and
    pushed, evictions, the staleness histogram, the gradient mass produced and applied per
    dimension) or ``replication`` (het_row_replicated: steps, all-hot steps that skipped the cold
    exchange, sparse and dense replica syncs; these count the module's steps, so every
    replicated table of one module shows the same).

    A model with a plan check (:func:`torchrec_het.watch_plan`, which ``install()`` sets up for a
    ``DistributedModelParallel`` whose plan carries the planner's prediction) adds ``plan_check`` to
    every table: ``predicted_step_ms`` (the plan's whole step), ``measured_step_ms`` (this rank's median
    step after warm-up; None until measured), ``steps`` (training steps the check saw) and, for tables
    the prediction prices, ``predicted_share_ms``, ``runner_up`` and ``runner_up_share_ms``; the
    plan's tables of TorchRec's types then appear too, with ``module`` (None where the plan is not
    known), ``sharding_type`` and ``plan_check``.
    """
    out: dict[str, dict] = {}
    for name, module in get_unwrapped_module(model).named_modules():
        if not isinstance(module, (HetShardedEmbeddingBagCollection, HetShardedEmbeddingCollection)):
            continue
        cache = module.cache_stats() if isinstance(module, HetShardedEmbeddingBagCollection) else {}
        replication = {key: int(value) for key, value in module.replication_stats().items()}
        for table, sharding in module.module_sharding_plan.items():
            kind = sharding.sharding_type
            if kind == HET_CACHED_ROW_WISE:
                out[table] = {"module": name, "sharding_type": kind, "cache": cache[table]}
            elif kind == HET_ROW_REPLICATED:
                out[table] = {"module": name, "sharding_type": kind, "replication": dict(replication)}
    watch = watch_of(model)
    if watch is not None:
        step = watch.as_dict()
        for table, predicted in watch.prediction.tables.items():
            out.setdefault(
                table,
                {"module": watch.table_modules.get(table), "sharding_type": predicted.get("sharding_type")},
            )
        for table, entry in out.items():
            predicted = watch.prediction.tables.get(table, {})
            entry["plan_check"] = dict(step)
            if predicted:
                entry["plan_check"].update(
                    predicted_share_ms=_number(predicted.get("share_ms")),
                    runner_up=predicted.get("runner_up"),
                    runner_up_share_ms=_number(predicted.get("runner_up_share_ms")),
                )
    return out


def _number(value) -> float | None:
    return None if value is None else float(value)


def describe_stats(stats: dict[str, dict]) -> list[str]:
    """One labelled line per plugin-sharded table of ``stats`` (what :func:`stats_by_table` gives);
    a cache that looked nothing up says so rather than show a hit rate of 0%."""
    lines = []
    for table, entry in stats.items():
        if "cache" in entry:
            lines.append(f"{table}: {describe_cache(entry['cache'])}")
        elif "replication" in entry:
            r = entry["replication"]
            lines.append(
                f"{table}: het_row_replicated: {r.get('steps', 0)} steps ({r.get('skipped_steps', 0)} all hot, "
                f"no cold exchange); replica syncs: {r.get('sparse_syncs', 0)} sparse (the rows read since the last "
                f"one), {r.get('dense_syncs', 0)} dense (every hot row: most were read)"
            )
    return lines


def describe_cache(cache: dict) -> str:
    """A ``het_cached_row_wise`` table's cache counters (``stats_by_table(model)[table]["cache"]``) in words."""
    lookups, remote = cache["lookups"], cache["remote_lookups"]
    if lookups == 0:
        return "het_cached_row_wise cache: no lookups on this rank yet, so no hit rate"
    if remote == 0:
        return f"het_cached_row_wise cache: {lookups} lookups, none of another rank's rows, so no hit rate"
    return (
        f"het_cached_row_wise cache: hit rate {cache['hit_rate_lookups']:.0%} of {remote} lookups of other "
        f"ranks' rows ({cache['hits_unique']} of {cache['remote_unique']} distinct rows); {cache['rows_fetched']} "
        f"rows fetched, {cache['rows_pushed']} pushed"
    )


__all__ = ["describe_cache", "describe_stats", "stats_by_table"]
