"""Rank bodies of tests/distributed/test_het_behaviour.py: what ``het_cached_row_wise`` promises.

:func:`run_world` is the ``torch.multiprocessing.spawn`` target. It joins a gloo group,
runs every check of :data:`CHECKS` in order and writes what the rank observed to
``<out_dir>/rank<r>.json`` (``{check: observation}``; an exception in a check is
recorded as ``{"error": traceback}`` and the next check runs). The checks only
observe; the test file holds the assertions.

Checks:

``bounds``
    One model, one pair of tables (40 rows, one feature; 70 rows, two features, the
    pair fused into one group) per (protocol, s_read, s_write, capacity); before
    every forward each rank all-gathers the owners' versions, and a :class:`ServeRecorder`
    (wrapped around each lookup's settle step) measures, for every id served from the cache, the version lag
    behind the true owner version and the age of its lease; after every step, the
    most updates a cached row holds back (``s_write``).
``nothing_lost``
    Gradient mass produced equals gradient mass applied at owners after
    ``flush_cache()`` and after ``state_dict()``; with SGD the owners' weights moved
    by exactly ``-lr`` times the applied mass.
``write_bound``
    ``s_write`` = 1000 with every remote row cached: nothing reaches an owner before
    the flush; the flush moves every owned row by ``-lr`` times the sum of the
    gradients the other ranks held back for it, and versions count every update.
``bad_input``
    Malformed batches raise ValueError naming the feature and change nothing.
``checkpoint``
    ``state_dict()`` / ``load_state_dict()`` round trip of a trained model.
"""

import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import HetShardedEmbeddingBagCollection
from torchrec_het.sharding.het_cache import protocol
from torchrec_het.sharding.het_cache.lookup import HetCachedEmbeddingLookup
from torchrec_het_testing.bag_models import loss_of, projections, sharded, table_configs
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

SEED = 11
LR = 0.002  # small enough that 14 SGD steps of the quadratic test loss do not diverge
BATCH = 8
MAX_BAG = 4  # bag lengths are drawn from 0..MAX_BAG

BOUND_STEPS = 12
PRESSURE_ROWS = 3  # the eviction-pressure capacity, in rows per table
BOUND_CASES: list[CacheSettings] = [  # LFU rides along with s_read = 3 so that both policies are covered
    CacheSettings(
        s_read=s_read, s_write=s_write, capacity=capacity, protocol=protocol, policy="lfu" if s_read == 3 else "lru"
    )
    for protocol in ("het", "lease")
    for s_read in (1, 3)
    for s_write in (0, 2)
    for capacity in (PRESSURE_ROWS, 1.0)
]

LOST_STEPS = 10  # steps before flush_cache() in nothing_lost
UNFLUSHED_STEPS = 4  # further steps before state_dict() in nothing_lost
WRITE_STEPS = 6  # steps before the flush in write_bound
BAD_FEATURES = {  # malformed-batch case -> the feature its error message must name
    "unknown_key": "bogus",
    "missing_key": "f2",
    "id_equal_rows": "f3",
    "negative_id": "f1",
    "lengths_mismatch": "f3",
    "negative_length": "f0",
}


CACHE_FIELDS = (  # what a row cache keeps between steps, compared field by field
    "slot_ids",
    "values",
    "versions",
    "validated_step",
    "pending_count",
    "pending_grad",
    "pending_delta",
    "last_used",
    "frequency",
)


def case_name(settings: CacheSettings) -> str:
    """The label of a bounds case, e.g. ``het_r1_w2_c3_lru`` or ``lease_r3_w0_full_lfu``."""
    capacity = "full" if isinstance(settings.capacity, float) else f"c{settings.capacity}"
    return f"{settings.protocol}_r{settings.s_read}_w{settings.s_write}_{capacity}_{settings.policy}"


# --- models, batches, state ---------------------------------------------------------------


def _model(configs: list[EmbeddingBagConfig], cache: HetCacheConfig, seed: int = SEED) -> DistributedModelParallel:
    """An EmbeddingBagCollection, every table ``het_cached_row_wise``, fused SGD(LR), weights by row."""
    return sharded("het", configs, False, "sgd", cache=cache, lr=LR, seed=seed)


def _sharded(model: DistributedModelParallel) -> HetShardedEmbeddingBagCollection:
    module = model._dmp_wrapped_module
    if not isinstance(module, HetShardedEmbeddingBagCollection):
        raise TypeError(f"expected the HET sharded EBC under DMP, got {type(module).__name__}")
    return module


def batch(rank: int, step: int, configs: list[EmbeddingBagConfig]) -> KeyedJaggedTensor:
    """A skewed multi-hot batch, the same for every run of (rank, step); every rank can build any rank's.

    Hot rows sit at the start of each table, shifted by 11 rows per table, so the
    ranks share hot rows (and contend for them) while owning different ranges.
    """
    generator = torch.Generator().manual_seed(7919 * rank + 104_729 * step + 17)
    keys, lengths, values = [], [], []
    for t, config in enumerate(configs):
        for feature in config.feature_names:
            n = torch.randint(0, MAX_BAG + 1, (BATCH,), generator=generator)
            skewed = (torch.rand(int(n.sum()), generator=generator) ** 3 * config.num_embeddings).long()
            keys.append(feature)
            lengths.append(n)
            values.append((skewed + 11 * t) % config.num_embeddings)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _ids_by_table(features: KeyedJaggedTensor, configs: list[EmbeddingBagConfig]) -> dict[str, torch.Tensor]:
    """Distinct ids of each table in a batch."""
    by_feature = features.to_dict()
    return {c.name: torch.unique(torch.cat([by_feature[f].values() for f in c.feature_names]).long()) for c in configs}


def _train_step(model: DistributedModelParallel, features: KeyedJaggedTensor, proj: dict[str, torch.Tensor]) -> float:
    loss = loss_of(model(features), proj)
    loss.backward()
    return float(loss)


def apply_pushes(lookups: list[HetCachedEmbeddingLookup]) -> None:
    """Applies the pushes of the last backward at their owners (the next lookup would do it first):
    the owner's weights and versions are read here as that lookup will see them."""
    for lookup in lookups:
        lookup.pushes.apply_arrived()


def _owned_weights(lookups: list[HetCachedEmbeddingLookup], rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Per table: (first owned row, a view of this rank's shard of the weights)."""
    out = {}
    for lookup in lookups:
        weights = [m.split_embedding_weights() for m in lookup_kernels(lookup)]
        for g in lookup.groups:
            for t in g.tables:
                out[t.name] = (int(t.row_starts[rank]), weights[t.module_index][t.table_index])
    return out


def _owned_versions(lookups: list[HetCachedEmbeddingLookup]) -> dict[str, torch.Tensor]:
    """Per table: the versions of this rank's owned rows, in row order."""
    return {
        t.name: g.versions[int(g.local_offsets[i]) : int(g.local_offsets[i + 1])].clone()
        for lookup in lookups
        for g in lookup.groups
        for i, t in enumerate(g.tables)
    }


def true_versions(lookups: list[HetCachedEmbeddingLookup], world_size: int) -> dict[str, torch.Tensor]:
    """Per table: every row's owner version (all-gathered; rank r's range follows rank r - 1's)."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * world_size
    dist.all_gather_object(gathered, _owned_versions(lookups))
    return {name: torch.cat([part[name] for part in gathered]) for name in gathered[0]}


def _cache_rows(lookups: list[HetCachedEmbeddingLookup]) -> int:
    return sum(len(g.cache) for lookup in lookups for g in lookup.groups)


def _pending(lookups: list[HetCachedEmbeddingLookup]) -> int:
    """Updates held back on this rank: in caches and in evicted rows not pushed yet."""
    cached = sum(int(g.cache.pending_count.sum()) for lookup in lookups for g in lookup.groups)
    outbox = sum(int(p.counts.sum()) for lookup in lookups for parts in lookup.pushes.outbox for p in parts)
    return cached + outbox


def _max_pending(lookups: list[HetCachedEmbeddingLookup]) -> dict[str, int]:
    """Per table: the most updates any of its cached rows holds back on this rank."""
    out = {}
    for lookup in lookups:
        for g in lookup.groups:
            cache = g.cache
            for i, t in enumerate(g.tables):
                counts = cache.pending_count[int(cache.slot_starts[i]) : int(cache.slot_starts[i + 1])]
                out[t.name] = int(counts.max()) if counts.numel() else 0
    return out


def _versions_nonzero(lookups: list[HetCachedEmbeddingLookup]) -> int:
    return sum(int((g.versions != 0).sum()) for lookup in lookups for g in lookup.groups)


def _snapshot(lookups: list[HetCachedEmbeddingLookup], rank: int) -> dict[str, torch.Tensor]:
    """Copies of everything a forward may change: weights, cache, versions, counters, step."""
    out = {f"weights/{name}": w.detach().clone() for name, (_, w) in _owned_weights(lookups, rank).items()}
    for li, lookup in enumerate(lookups):
        out[f"{li}/step"] = torch.tensor(lookup.clock)
        out[f"{li}/outbox"] = torch.tensor([len(parts) for parts in lookup.pushes.outbox])
        for gi, g in enumerate(lookup.groups):
            cache = g.cache
            for attr in CACHE_FIELDS:
                out[f"{li}/{gi}/cache.{attr}"] = getattr(cache, attr).clone()
            out[f"{li}/{gi}/versions"] = g.versions.clone()
            for name, counter in g.stats.counters.items():
                out[f"{li}/{gi}/stats.{name}"] = counter.clone()
            out[f"{li}/{gi}/stats.grad_produced"] = g.stats.grad_produced.clone()
    return out


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))


def gradient_mass(sharded: HetShardedEmbeddingBagCollection) -> dict[str, dict[str, list[float]]]:
    stats = sharded.cache_stats()
    return {name: {"produced": s["grad_produced"], "applied": s["grad_applied"]} for name, s in stats.items()}


# --- 1. bounds ------------------------------------------------------------------------------


class ServeRecorder:
    """Per table, how far each copy served from the cache lags the true owner version, and the age of its lease.

    The runtime has no test hook: :meth:`attach` instruments the cache from here, wrapping the
    protocol's settle step (:func:`~torchrec_het.sharding.het_cache.protocol.settle`: stale copies
    refreshed, new rows filled, the batch's rows gathered) and reading, right after each call, the
    cached copies it served without fetching them, as the forward pools them. Set :attr:`truth`
    (every row's owner version) and :attr:`step` before each step; :meth:`detach` when done.

    Args:
        rank: this rank.
        row_starts: per table, int64 ``[world_size + 1]`` ownership boundaries.
    """

    def __init__(self, rank: int, row_starts: dict[str, torch.Tensor]) -> None:
        self.rank, self.row_starts = rank, row_starts
        self.truth: dict[str, torch.Tensor] = {}
        self.step = -1
        self.records = {
            name: {
                "served": 0,
                "calls": 0,
                "wrong_step": 0,
                "not_remote": 0,
                "max_lag": 0,
                "min_lag": 0,
                "max_age": 0,
                "min_age": 0,
            }
            for name in row_starts
        }
        self._settle = None

    @classmethod
    def attach(cls, lookups: list[HetCachedEmbeddingLookup], rank: int) -> "ServeRecorder":
        """A recorder of every table of ``lookups``, observing every settle of their groups from now on
        (in this process: a spawned rank)."""
        row_starts = {t.name: t.row_starts for lookup in lookups for g in lookup.groups for t in g.tables}
        recorder = cls(rank, row_starts)
        recorder._settle = protocol.settle

        def settle_and_record(g, read, *args, **kwargs) -> torch.Tensor:
            served = recorder._settle(g, read, *args, **kwargs)
            recorder.record_group(g, read, served)
            return served

        protocol.settle = settle_and_record
        return recorder

    def detach(self) -> None:
        """The protocol's own settle step again."""
        if self._settle is not None:
            protocol.settle, self._settle = self._settle, None

    def record_group(self, group, read, served: torch.Tensor) -> None:
        """Records, per table of ``group`` this recorder follows, the copies one settled batch served
        from the cache (``served``: per remote id, no row came for it)."""
        if group.tables[0].name not in self.records:
            return
        hit = read.slots[served]
        ids, tables = read.uniq[read.remote[served]], read.tables.index_select(0, read.remote)[served]
        cache = group.cache
        for i, t in enumerate(group.tables):
            mine = tables == i
            self(
                t.name,
                ids[mine] - group.offsets[i],
                cache.versions[hit[mine]],
                cache.validated_step[hit[mine]],
                read.step,
            )

    def __call__(
        self, table: str, ids: torch.Tensor, versions: torch.Tensor, validated: torch.Tensor, step: int
    ) -> None:
        """Records one table's ids served from the cache in one forward, with their copies' versions
        and validation steps, and the lookup's step."""
        record = self.records[table]
        record["calls"] += 1
        record["wrong_step"] += int(step != self.step)
        if ids.numel() == 0:
            return
        starts = self.row_starts[table]
        record["served"] += ids.numel()
        mine = (ids >= starts[self.rank]) & (ids < starts[self.rank + 1])
        out_of_range = (ids < 0) | (ids >= starts[-1])
        record["not_remote"] += int((mine | out_of_range).sum())
        lag = self.truth[table][ids.clamp(0, int(starts[-1]) - 1)] - versions
        age = step - validated
        record["max_lag"] = max(record["max_lag"], int(lag.max()))
        record["min_lag"] = min(record["min_lag"], int(lag.min()))
        record["max_age"] = max(record["max_age"], int(age.max()))
        record["min_age"] = min(record["min_age"], int(age.min()))


def bound_configs(cases: tuple = BOUND_CASES) -> tuple[list[EmbeddingBagConfig], HetCacheConfig]:
    """Two tables per cache setting (one feature, two features) and the cache config that gives them it."""
    configs, per_table = [], {}
    for settings in cases:
        name = case_name(settings)
        configs.append(
            EmbeddingBagConfig(name=f"{name}_a", feature_names=[f"{name}_a"], embedding_dim=4, num_embeddings=40)
        )
        configs.append(
            EmbeddingBagConfig(
                name=f"{name}_b", feature_names=[f"{name}_b0", f"{name}_b1"], embedding_dim=4, num_embeddings=70
            )
        )
        per_table[f"{name}_a"] = per_table[f"{name}_b"] = settings
    return configs, HetCacheConfig(default=cases[0], per_table=per_table)


def bounds(rank: int, world_size: int) -> dict:
    """Per case and table: served ids, max lag / lease age, cache counters, remote ids per batch, and
    the most updates a cached row held back after any step (the write bound).

    Returns:
        ``{"tables": {table: {...}}, "groups": int, "losses": [float]}``.
    """
    configs, cache = bound_configs()
    model = _model(configs, cache)
    sharded = _sharded(model)
    lookups = sharded.het_lookups()
    proj = projections(configs)
    recorder = ServeRecorder.attach(lookups, rank)
    min_remote = {c.name: 1 << 30 for c in configs}
    max_remote = {c.name: 0 for c in configs}
    max_pending = {c.name: 0 for c in configs}
    losses = []
    try:
        for step in range(BOUND_STEPS):
            apply_pushes(lookups)
            recorder.truth = true_versions(lookups, world_size)  # versions move when pushes are applied and at flush
            recorder.step = step
            features = batch(rank, step, configs)
            for name, ids in _ids_by_table(features, configs).items():
                starts = recorder.row_starts[name]
                remote = (ids < starts[rank]) | (ids >= starts[rank + 1])
                min_remote[name] = min(min_remote[name], int(remote.sum()))
                max_remote[name] = max(max_remote[name], int(remote.sum()))
            losses.append(_train_step(model, features, proj))
            for name, held in _max_pending(lookups).items():
                max_pending[name] = max(max_pending[name], held)
    finally:
        recorder.detach()
    stats = sharded.cache_stats()
    tables = {}
    for name, record in recorder.records.items():
        s = stats[name]
        tables[name] = {
            **record,
            "hits_unique": s["hits_unique"],
            "remote_unique": s["remote_unique"],
            "evictions": s["evictions"],
            "dirty_evictions": s["dirty_evictions"],
            "rows_fetched": s["rows_fetched"],
            "min_remote_ids": min_remote[name],
            "max_remote_ids": max_remote[name],
            "max_pending": max_pending[name],
        }
    return {"tables": tables, "groups": sum(len(lookup.groups) for lookup in lookups), "losses": losses}


# --- 2. nothing lost ----------------------------------------------------------------------------


def _weight_moves(lookups, rank: int, initial: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per table: sum over owned rows of (weights now - initial weights), float64, per column."""
    return {
        name: (w.detach().double() - initial[name].double()).sum(0).tolist()
        for name, (_, w) in _owned_weights(lookups, rank).items()
    }


def nothing_lost(rank: int, world_size: int) -> dict:
    """Gradient mass and weight movement after flush_cache() and after a state_dict() that flushes.

    Returns:
        ``{"flushed": {table: {"produced", "applied", "moved"}}, "state_dict": {...} (same),
        "pending_before_state_dict": int, "unflushed": {table: {"produced", "applied"}},
        "dirty_evictions": int, "rows_pushed": int}``.
    """
    configs = table_configs(weighted=False)
    model = _model(configs, HetCacheConfig(default=CacheSettings(s_read=2, s_write=3, capacity=PRESSURE_ROWS)))
    sharded = _sharded(model)
    lookups = sharded.het_lookups()
    proj = projections(configs)
    initial = {name: w.detach().clone() for name, (_, w) in _owned_weights(lookups, rank).items()}
    for step in range(LOST_STEPS):
        _train_step(model, batch(rank, step, configs), proj)
    sharded.flush_cache()
    out = {"flushed": gradient_mass(sharded), "pending_after_flush": _pending(lookups)}
    for name, moved in _weight_moves(lookups, rank, initial).items():
        out["flushed"][name]["moved"] = moved
    for step in range(LOST_STEPS, LOST_STEPS + UNFLUSHED_STEPS):
        _train_step(model, batch(rank, step, configs), proj)
    out["pending_before_state_dict"] = _pending(lookups)
    out["unflushed"] = gradient_mass(sharded)
    model.state_dict()
    out["state_dict"] = gradient_mass(sharded)
    out["pending_after_state_dict"] = _pending(lookups)
    for name, moved in _weight_moves(lookups, rank, initial).items():
        out["state_dict"][name]["moved"] = moved
    stats = sharded.cache_stats()
    out["dirty_evictions"] = sum(s["dirty_evictions"] for s in stats.values())
    out["rows_pushed"] = sum(s["rows_pushed"] for s in stats.values())
    return out


# --- 2b. an exact cache: the fetched-rows tier counts as HET's cache counts ---------------------

EXACT_STEPS = 5


def _shard_weights(model: DistributedModelParallel, configs: list[EmbeddingBagConfig]) -> dict[str, tuple]:
    """Per table: (this rank's first row, a copy of its shard of the weights), from the state dict."""
    state = model.state_dict()
    out = {}
    for c in configs:
        (shard,) = next(v for k, v in state.items() if k.endswith(f".{c.name}.weight")).local_shards()
        out[c.name] = (int(shard.metadata.shard_offsets[0]), shard.tensor.detach().clone())
    return out


def exact_counters(rank: int, world_size: int) -> dict:
    """An exact cache (both bounds 0) trains ``EXACT_STEPS`` steps: its counters beside the counts
    this rank's batches imply, and the weights its shards moved (SGD).

    Returns:
        ``{"lookup": class name, "stats": cache_stats(), "expected": {table: {counter: n}},
        "mass": {table: {"produced", "applied", "moved"}}}``.
    """
    configs = table_configs(weighted=False)
    model = _model(configs, HetCacheConfig(default=CacheSettings(s_read=0, s_write=0, capacity=PRESSURE_ROWS)))
    sharded = _sharded(model)
    proj = projections(configs)
    before = _shard_weights(model, configs)
    owners = {c.name: torch.tensor([int(s.shard_offsets[0]) for s in sharded.module_sharding_plan[c.name].sharding_spec.shards][1:]) for c in configs}  # fmt: skip
    expected = {
        c.name: dict.fromkeys(("lookups", "unique_lookups", "remote_unique", "remote_lookups"), 0) for c in configs
    }
    for step in range(EXACT_STEPS):
        features = batch(rank, step, configs)
        by_feature = features.to_dict()
        for c in configs:
            ids = torch.cat([by_feature[f].values() for f in c.feature_names]).long()
            remote = torch.bucketize(ids, owners[c.name], right=True) != rank
            counts = expected[c.name]
            counts["lookups"] += ids.numel()
            counts["unique_lookups"] += torch.unique(ids).numel()
            counts["remote_unique"] += torch.unique(ids[remote]).numel()
            counts["remote_lookups"] += int(remote.sum())
        _train_step(model, features, proj)
    after = _shard_weights(model, configs)
    stats = sharded.cache_stats()
    mass = {
        name: {
            "produced": s["grad_produced"],
            "applied": s["grad_applied"],
            "moved": (after[name][1] - before[name][1]).sum(0).tolist(),
        }
        for name, s in stats.items()
    }
    kinds = sorted({type(lookup).__name__ for lookup in sharded.het_lookups()})
    return {"lookups": kinds, "stats": stats, "expected": expected, "mass": mass}


# --- 3. s_write: nothing reaches an owner before the flush --------------------------------------


def _held_back(lookups: list[HetCachedEmbeddingLookup]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per table: (rows, pending gradients, pending counts) of cached rows with pending updates."""
    out = {}
    for lookup in lookups:
        for g in lookup.groups:
            cache = g.cache
            slots = (cache.pending_count > 0).nonzero().flatten()
            ids = cache.slot_ids[slots]
            tables = g.table_of(ids)
            for i, t in enumerate(g.tables):
                mine = tables == i
                out[t.name] = (
                    ids[mine] - g.offsets[i],
                    cache.pending_grad[slots[mine]].clone(),
                    cache.pending_count[slots[mine]],
                )
    return out


def write_bound(rank: int, world_size: int) -> dict:
    """``s_write`` = 1000, every remote row cached, het protocol with ``s_read`` = 0, WRITE_STEPS steps.

    Returns:
        Per-rank observations: ``pushed_before_flush`` (rows sent to other owners),
        ``evictions``, ``untouched_moved`` (largest move of an owned row this rank
        never read), ``held_rows`` (owned rows with gradients held by other ranks),
        ``flush_error`` / ``flush_scale`` (largest deviation of the flushed weights
        from ``before - LR * sum of held-back gradients``, and the largest such
        move), ``version_errors`` (owned rows whose version is not the number of
        updates they received).
    """
    configs = table_configs(weighted=False)
    model = _model(configs, HetCacheConfig(default=CacheSettings(s_read=0, s_write=1000, capacity=1.0)))
    sharded = _sharded(model)
    lookups = sharded.het_lookups()
    proj = projections(configs)
    initial = {name: w.detach().clone() for name, (_, w) in _owned_weights(lookups, rank).items()}
    local_updates = {c.name: torch.zeros(c.num_embeddings, dtype=torch.int64) for c in configs}
    for step in range(WRITE_STEPS):
        features = batch(rank, step, configs)
        for name, ids in _ids_by_table(features, configs).items():
            local_updates[name][ids] += 1  # one update per distinct row per step
        _train_step(model, features, proj)
    stats = sharded.cache_stats()
    apply_pushes(lookups)
    owned = _owned_weights(lookups, rank)
    before = {name: w.detach().clone() for name, (_, w) in owned.items()}
    out = {
        "pushed_before_flush": sum(s["rows_pushed"] for s in stats.values()),
        "evictions": sum(s["evictions"] for s in stats.values()),
        "untouched_moved": 0.0,
    }
    for name, (start, w) in owned.items():
        untouched = local_updates[name][start : start + w.size(0)] == 0
        moved = (before[name] - initial[name])[untouched].abs()
        out["untouched_moved"] = max(out["untouched_moved"], float(moved.max()) if moved.numel() else 0.0)
    gathered: list[dict | None] = [None] * world_size
    dist.all_gather_object(gathered, _held_back(lookups))
    expected = {name: before[name].double().clone() for name in before}
    updates = {name: torch.zeros(w.size(0), dtype=torch.int64) for name, (_, w) in owned.items()}
    held_rows = owned_cached = 0
    for source, held in enumerate(gathered):
        for name, (rows, grads, counts) in held.items():
            start, w = owned[name]
            mine = (rows >= start) & (rows < start + w.size(0))
            if source == rank:
                owned_cached += int(mine.sum())
                continue
            held_rows += int(mine.sum())
            expected[name].index_add_(0, rows[mine] - start, -LR * grads[mine].double())
            updates[name].index_add_(0, rows[mine] - start, counts[mine])
    sharded.flush_cache()
    versions = _owned_versions(lookups)
    out.update(held_rows=held_rows, owned_cached=owned_cached, flush_error=0.0, flush_scale=0.0, version_errors=0)
    for name, (start, w) in owned.items():
        out["flush_error"] = max(out["flush_error"], float((w.detach().double() - expected[name]).abs().max()))
        out["flush_scale"] = max(out["flush_scale"], float((expected[name] - before[name].double()).abs().max()))
        want = updates[name] + local_updates[name][start : start + w.size(0)]
        out["version_errors"] += int((versions[name] != want).sum())
    return out


# --- 4. bad input ---------------------------------------------------------------------------------


def _per_key(features: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (jt.lengths().clone(), jt.values().clone()) for k, jt in features.to_dict().items()}


def _kjt(parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> KeyedJaggedTensor:
    """A KJT from per-key (lengths, values) without any consistency check."""
    return KeyedJaggedTensor(
        keys=list(parts),
        values=torch.cat([v for _, v in parts.values()]),
        lengths=torch.cat([n for n, _ in parts.values()]),
    )


def bad_batches(good: KeyedJaggedTensor, configs: list[EmbeddingBagConfig]) -> dict[str, KeyedJaggedTensor]:
    """One malformed batch per case of :data:`BAD_FEATURES`, derived from ``good``."""
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    out = {}
    parts = _per_key(good)
    parts["bogus"] = (torch.ones(BATCH, dtype=torch.int64), torch.zeros(BATCH, dtype=torch.int64))
    out["unknown_key"] = _kjt(parts)
    parts = _per_key(good)
    del parts["f2"]
    out["missing_key"] = _kjt(parts)
    parts = _per_key(good)
    ids = torch.arange(BATCH) % rows["f3"]
    ids[BATCH // 2] = rows["f3"]
    parts["f3"] = (torch.ones(BATCH, dtype=torch.int64), ids)
    out["id_equal_rows"] = _kjt(parts)
    parts = _per_key(good)
    ids = torch.arange(BATCH) % rows["f1"]
    ids[1] = -1
    parts["f1"] = (torch.ones(BATCH, dtype=torch.int64), ids)
    out["negative_id"] = _kjt(parts)
    parts = _per_key(good)
    parts["f3"][0][-1] += 1  # the last feature's last bag claims one id more than the batch holds
    out["lengths_mismatch"] = _kjt(parts)
    parts = _per_key(good)
    lengths = torch.ones(BATCH, dtype=torch.int64)
    lengths[0], lengths[1] = -1, 3  # same total as all ones
    parts["f0"] = (lengths, torch.zeros(BATCH, dtype=torch.int64))
    out["negative_length"] = _kjt(parts)
    return out


def bad_input(rank: int, world_size: int) -> dict:
    """After 3 training steps (s_read = s_write = 2, 3 cached rows per table), every malformed batch.

    Returns:
        ``{case: {"raised": exception type or None, "message": str, "changed": [state keys]}}``
        plus ``"after": loss of a good step afterwards`` and ``"pending": updates held
        back when the bad batches came``.
    """
    configs = table_configs(weighted=False)
    model = _model(configs, HetCacheConfig(default=CacheSettings(s_read=2, s_write=2, capacity=PRESSURE_ROWS)))
    lookups = _sharded(model).het_lookups()
    proj = projections(configs)
    for step in range(3):
        _train_step(model, batch(rank, step, configs), proj)
    out: dict = {"pending": _pending(lookups), "cache_rows": _cache_rows(lookups)}
    for case, features in bad_batches(batch(rank, 3, configs), configs).items():
        before = _snapshot(lookups, rank)
        raised, message = None, ""
        try:
            model(features)
        except Exception as error:  # noqa: BLE001 - the test asserts the type
            raised, message = type(error).__name__, str(error)
        out[case] = {"raised": raised, "message": message, "changed": _changed(before, _snapshot(lookups, rank))}
    out["after"] = _train_step(model, batch(rank, 3, configs), proj)
    return out


# --- 5. checkpoint ------------------------------------------------------------------------------


def _local_shards(state: dict) -> dict[str, torch.Tensor]:
    return {
        key: shard.tensor.detach().clone()
        for key, value in state.items()
        if hasattr(value, "local_shards")
        for shard in value.local_shards()
    }


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if set(got) != set(want):
        return float("inf")
    return max(float((got[k] - want[k]).abs().max()) if got[k].numel() else 0.0 for k in want)


def _cache_state(lookups) -> dict[str, int]:
    return {
        "cache_rows": _cache_rows(lookups),
        "versions_nonzero": _versions_nonzero(lookups),
        "pending": _pending(lookups),
    }


def checkpoint(rank: int, world_size: int) -> dict:
    """Train A (s=2, 3 cached rows per table) 4 steps, save, load into a trained B and into A, go on.

    Returns:
        ``a_before_save`` / ``a_after_save`` / ``b_before_load`` / ``b_after_load`` /
        ``a_after_load``: cache rows, nonzero versions and pending updates;
        ``b_weights_err`` / ``a_weights_err``: largest difference from the saved
        shards after loading; ``saved_vs_initial``: how far training moved them;
        ``continued_out_err`` / ``continued_weights_err``: A and B trained 3 more
        steps on the same batches.
    """
    configs = table_configs(weighted=False)
    cache = HetCacheConfig(default=CacheSettings(s_read=2, s_write=2, capacity=PRESSURE_ROWS))
    proj = projections(configs)
    a = _model(configs, cache)
    b = _model(configs, cache, seed=SEED + 1)
    a_lookups, b_lookups = _sharded(a).het_lookups(), _sharded(b).het_lookups()
    initial = _local_shards(a.state_dict())
    for step in range(4):
        _train_step(a, batch(rank, step, configs), proj)
    for step in range(2):
        _train_step(b, batch(rank, 50 + step, configs), proj)
    out: dict = {"a_before_save": _cache_state(a_lookups)}
    state = a.state_dict()
    saved = _local_shards(state)
    out["a_after_save"] = _cache_state(a_lookups)
    out["saved_vs_initial"] = _max_diff(saved, initial)
    out["b_before_load"] = _cache_state(b_lookups)
    b.load_state_dict(state)
    out["b_after_load"] = _cache_state(b_lookups)
    out["b_weights_err"] = _max_diff(_local_shards(b.state_dict()), saved)
    a.load_state_dict(state)
    out["a_after_load"] = _cache_state(a_lookups)
    out["a_weights_err"] = _max_diff(_local_shards(a.state_dict()), saved)
    out_err = 0.0
    for step in range(3):
        features = batch(rank, 10 + step, configs)
        pooled_a, pooled_b = a(features), b(features)
        out_err = max(out_err, max(float((pooled_a[f] - pooled_b[f]).abs().max()) for f in proj))
        loss_of(pooled_a, proj).backward()
        loss_of(pooled_b, proj).backward()
    out["continued_out_err"] = out_err
    out["continued_weights_err"] = _max_diff(_local_shards(a.state_dict()), _local_shards(b.state_dict()))
    return out


# --- the world ----------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[int, int], dict]] = {
    "bounds": bounds,
    "nothing_lost": nothing_lost,
    "exact_counters": exact_counters,
    "write_bound": write_bound,
    "bad_input": bad_input,
    "checkpoint": checkpoint,
}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every check of :data:`CHECKS`; writes ``rank<r>.json`` (``"seconds"``: time per check)."""
    results: dict = {}
    with gloo_rank(rank, world_size, port, timeout_s=90):
        for name, check in CHECKS.items():
            started = time.perf_counter()
            try:
                results[name] = check(rank, world_size)
            except Exception:  # noqa: BLE001 - recorded, asserted by the test
                results[name] = {"error": traceback.format_exc()}
            results.setdefault("seconds", {})[name] = time.perf_counter() - started
    write_rank_result(out_dir, rank, results)
