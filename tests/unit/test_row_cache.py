"""RowCache: slots, eviction policies, read-your-writes, due pushes, and no gradient lost."""

import pytest
import torch

from torchrec_het.cache import PendingRows, RowCache
from torchrec_het_bench.ideal_cache import lru_hits

DTYPES = [torch.float32, torch.float64]


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _rows(n: int, dim: int = 2, start: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n * dim, dtype=dtype).view(n, dim) + start


def _fill(cache: RowCache, ids: torch.Tensor, step: int = 0) -> torch.Tensor:
    slots, _, _ = cache.insert(ids, _rows(ids.numel(), cache.dim), torch.zeros_like(ids), step)
    return slots


def test_insert_and_find() -> None:
    cache = RowCache(num_rows=10, dim=2, capacity=3)
    slots, dirty, evicted = cache.insert(_ids(4, 7), _rows(2), _ids(5, 6), step=1)
    assert slots.tolist() == [0, 1] and len(dirty) == 0 and evicted.numel() == 0
    assert cache.slots_of(_ids(7, 4, 3, 7, 4)).tolist() == [1, 0, -1, 1, 0]  # repeated ids
    assert cache.slots_of(_ids(7)).dtype == torch.int64
    assert len(cache) == 2 and cache.slot_ids.tolist() == [4, 7, -1]
    assert cache.versions[slots].tolist() == [5, 6] and cache.validated_step[slots].tolist() == [1, 1]
    assert cache.last_used[slots].tolist() == [1, 1] and cache.frequency[slots].tolist() == [1, 1]
    assert torch.equal(cache.values[slots], _rows(2))


def test_bad_arguments() -> None:
    for kwargs, match in (
        ({"policy": "fifo"}, "policy"),
        ({"capacity": -1}, "capacity"),
        ({"num_rows": 0}, "num_rows"),
        ({"dim": 0}, "dim"),
        ({"capacity": [1, 2], "partition_ends": [5]}, "partition_ends"),
    ):
        with pytest.raises(ValueError, match=match):
            RowCache(**{"num_rows": 10, "dim": 2, "capacity": 3, **kwargs})
    cache = RowCache(10, 2, 3)
    for bad in (_ids(10), _ids(-1), _ids(3, 11)):
        with pytest.raises(ValueError, match=r"\[0, 10\)"):
            cache.slots_of(bad)
    cache.insert(_ids(1), _rows(1), _ids(0), step=0)
    with pytest.raises(ValueError, match="not cached yet"):
        cache.insert(_ids(1), _rows(1), _ids(0), step=0)
    with pytest.raises(ValueError, match="distinct"):
        cache.insert(_ids(2, 2), _rows(2), _ids(0, 0), step=0)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        cache.insert(_ids(12), _rows(1), _ids(0), step=0)
    with pytest.raises(ValueError, match="values"):
        cache.insert(_ids(2), _rows(1, dim=3), _ids(0), step=0)
    with pytest.raises(ValueError, match="at least one"):
        PendingRows.concat([])


@pytest.mark.parametrize("capacity", [0, 3])
def test_empty_tensors_everywhere(capacity: int) -> None:
    cache = RowCache(10, 2, capacity, dtype=torch.float64)
    none, no_rows = _ids(), torch.empty(0, 2, dtype=torch.float64)
    assert cache.slots_of(none).shape == (0,)
    slots, dirty, evicted = cache.insert(none, no_rows, none, step=0, protect=none)
    assert slots.shape == (0,) and len(dirty) == 0 and evicted.shape == (0,)
    cache.touch(none, 1)
    cache.touch(none, 1, uses=none)
    cache.refresh(none, no_rows, none, 1)
    cache.mark_validated(none, 1)
    cache.accumulate(none, no_rows, no_rows)
    for taken in (cache.take_due(0), cache.take_all()):
        assert len(taken) == 0 and taken.grads.shape == (0, 2) and taken.grads.dtype == torch.float64
    assert len(cache) == 0
    empty = PendingRows.empty(2, torch.float64)
    both = PendingRows.concat([empty, PendingRows(_ids(3), torch.ones(1, 2, dtype=torch.float64), _ids(2))])
    assert len(both) == 1 and both.ids.tolist() == [3] and both.counts.tolist() == [2]


def test_capacity_zero_caches_nothing() -> None:
    cache = RowCache(10, 2, 0)
    slots, dirty, evicted = cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=0)
    assert slots.tolist() == [-1, -1] and len(dirty) == 0 and evicted.numel() == 0 and len(cache) == 0
    assert cache.slots_of(_ids(1, 2)).tolist() == [-1, -1] and len(cache.take_all()) == 0
    assert cache.nbytes() == 0  # no slots, no id -> slot map
    assert cache.held_versions(_ids(-1, -1)).tolist() == [-1, -1]


def test_first_ids_get_the_slots_when_capacity_is_short() -> None:
    cache = RowCache(10, 2, 2)
    slots, _, evicted = cache.insert(_ids(9, 3, 5, 1), _rows(4), _ids(0, 0, 0, 0), step=0)
    assert slots.tolist() == [0, 1, -1, -1] and evicted.numel() == 0
    assert cache.slots_of(_ids(9, 3, 5, 1)).tolist() == [0, 1, -1, -1]


def test_lru_and_lfu_choose_different_victims() -> None:
    for policy, victim in (("lru", 1), ("lfu", 2)):
        cache = RowCache(10, 2, 2, policy=policy)
        _fill(cache, _ids(1, 2))
        cache.touch(cache.slots_of(_ids(1)), step=1, uses=_ids(5))  # row 1: used often, long ago
        cache.touch(cache.slots_of(_ids(2)), step=3)  # row 2: used once, recently
        assert cache.frequency.tolist() == [6, 2] and cache.last_used.tolist() == [1, 3]
        _, _, evicted = cache.insert(_ids(3), _rows(1), _ids(0), step=4)
        assert evicted.tolist() == [victim] and cache.slots_of(_ids(victim)).item() == -1, policy
        assert len(cache) == 2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_ties_go_to_the_secondary_key_then_the_smallest_slot(policy: str) -> None:
    cache = RowCache(20, 2, 6, policy=policy)
    _fill(cache, _ids(10, 11, 12, 13, 14, 15))  # slots 0..5, all last_used 0, frequency 1
    cache.touch(_ids(0, 2, 4), step=0)  # slots 0, 2, 4: same step, frequency 2
    # lru: last_used ties everywhere, frequency 1 goes first -> slots 1, 3, then 5
    # lfu: frequency 1 on slots 1, 3, 5, last_used ties -> smallest slots 1, 3
    slots, _, evicted = cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=1)
    assert slots.tolist() == [1, 3] and evicted.tolist() == [11, 13]
    cache.touch(_ids(1, 3), step=1, uses=_ids(3, 3))  # the new rows: recent and frequent
    _, _, evicted = cache.insert(_ids(3), _rows(1), _ids(0), step=2)
    assert evicted.tolist() == [15]  # lru: step-0 rows, frequency 1 first; lfu: frequency 1
    _, _, evicted = cache.insert(_ids(4, 5), _rows(2), _ids(0, 0), step=3)
    # slots 0, 2, 4 tie on both keys (step 0, frequency 2): smallest slots first;
    # lfu takes the fresh row 3 (frequency 1) before them, lru keeps it (used at step 2)
    assert evicted.tolist() == ([10, 12] if policy == "lru" else [3, 10])


def test_protected_slots_survive_and_free_slots_still_fill() -> None:
    cache = RowCache(10, 2, 3)
    _fill(cache, _ids(1, 2))
    protect = cache.slots_of(_ids(1, 2))  # every occupied slot
    slots, dirty, evicted = cache.insert(_ids(3, 4), _rows(2), _ids(0, 0), step=1, protect=protect)
    assert slots.tolist() == [2, -1] and evicted.numel() == 0 and len(dirty) == 0
    assert (cache.slots_of(_ids(1, 2, 3)) >= 0).all() and len(cache) == 3
    protect = cache.slots_of(_ids(2, 7))  # -1 entries are ignored
    slots, _, evicted = cache.insert(_ids(4, 5), _rows(2), _ids(0, 0), step=2, protect=protect)
    assert slots.tolist() == [0, 2] and evicted.tolist() == [1, 3]
    assert cache.slots_of(_ids(1, 3)).tolist() == [-1, -1] and cache.slots_of(_ids(2)).item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_dirty_eviction_returns_its_pending_mass(dtype: torch.dtype) -> None:
    cache = RowCache(10, 2, 1, dtype=dtype)
    slots, _, _ = cache.insert(_ids(6), _rows(1, dtype=dtype), _ids(0), step=0)
    cache.accumulate(slots, torch.ones(1, 2, dtype=dtype), torch.zeros(1, 2, dtype=dtype))
    cache.accumulate(slots, torch.full((1, 2), 2.5, dtype=dtype), torch.zeros(1, 2, dtype=dtype))
    _, dirty, evicted = cache.insert(_ids(7), _rows(1, dtype=dtype), _ids(0), step=1)
    assert evicted.tolist() == [6] and dirty.ids.tolist() == [6] and dirty.counts.tolist() == [2]
    assert dirty.grads.dtype == dtype and torch.equal(dirty.grads, torch.full((1, 2), 3.5, dtype=dtype))
    assert cache.pending_count.tolist() == [0] and (cache.pending_grad == 0).all()
    _, dirty, evicted = cache.insert(_ids(8), _rows(1, dtype=dtype), _ids(0), step=2)  # row 7 was clean
    assert evicted.tolist() == [7] and len(dirty) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_your_writes_survives_a_refresh(dtype: torch.dtype) -> None:
    cache = RowCache(10, 2, 2, dtype=dtype)
    slots, _, _ = cache.insert(_ids(3), torch.zeros(1, 2, dtype=dtype), _ids(0), step=0)
    cache.accumulate(slots, torch.ones(1, 2, dtype=dtype), torch.full((1, 2), -0.5, dtype=dtype))
    assert torch.equal(cache.values[slots], torch.full((1, 2), -0.5, dtype=dtype))
    cache.refresh(slots, torch.full((1, 2), 10.0, dtype=dtype), _ids(4), step=3)
    assert torch.equal(cache.values[slots], torch.full((1, 2), 9.5, dtype=dtype))  # owner value + own update
    assert cache.versions[slots].item() == 4 and cache.validated_step[slots].item() == 3
    cache.mark_validated(slots, step=5)
    assert cache.validated_step[slots].item() == 5 and cache.versions[slots].item() == 4
    due = cache.take_all()
    assert due.ids.tolist() == [3] and torch.equal(due.grads, torch.ones(1, 2, dtype=dtype))
    assert (cache.pending_delta == 0).all()
    cache.refresh(slots, torch.full((1, 2), 10.0, dtype=dtype), _ids(5), step=6)
    assert torch.equal(cache.values[slots], torch.full((1, 2), 10.0, dtype=dtype))  # pushed: nothing re-applied


def test_take_due_is_strictly_above_the_bound() -> None:
    cache = RowCache(10, 2, 3)
    slots = _fill(cache, _ids(5, 1, 3))
    cache.accumulate(slots, torch.ones(3, 2), torch.zeros(3, 2))
    cache.accumulate(slots[:1], torch.ones(1, 2), torch.zeros(1, 2))
    assert len(cache.take_due(2)) == 0
    due = cache.take_due(1)
    assert due.ids.tolist() == [5] and due.counts.tolist() == [2]  # two updates > 1
    assert torch.equal(due.grads, torch.full((1, 2), 2.0))
    assert cache.take_due(0).ids.tolist() == [1, 3]  # s_write=0: any pending row; ascending ids
    assert len(cache.take_all()) == 0


def test_clear_forgets_everything() -> None:
    cache = RowCache(10, 2, 2)
    slots = _fill(cache, _ids(1, 2))
    cache.accumulate(slots, torch.ones(2, 2), torch.zeros(2, 2))
    cache.clear()
    assert len(cache) == 0 and (cache.slots_of(_ids(1, 2)) == -1).all() and len(cache.take_all()) == 0
    assert _fill(cache, _ids(2, 1)).tolist() == [0, 1]


@pytest.mark.parametrize("dtype, value_bytes", [(torch.float32, 4), (torch.float64, 8)])
def test_nbytes(dtype: torch.dtype, value_bytes: int) -> None:
    cache = RowCache(100, 4, 10, dtype=dtype)
    assert cache.nbytes() == 3 * 10 * 4 * value_bytes + 6 * 10 * 8 + 100 * 4


def test_partitions_keep_their_own_capacity() -> None:
    # ids 0..4 are table A (1 slot), ids 5..9 table B (2 slots)
    cache = RowCache(10, 2, capacity=[1, 2], partition_ends=[5, 10])
    slots, _, evicted = cache.insert(_ids(1, 6, 2, 7, 8), _rows(5), _ids(0, 0, 0, 0, 0), step=0)
    assert slots.tolist() == [0, 1, -1, 2, -1] and evicted.numel() == 0
    assert cache.partition_of(_ids(4, 5)).tolist() == [0, 1]
    slots, _, evicted = cache.insert(_ids(3), _rows(1), _ids(0), step=1)  # evicts row 1, never a B row
    assert slots.tolist() == [0] and evicted.tolist() == [1]
    assert cache.slots_of(_ids(1)).item() == -1 and (cache.slots_of(_ids(6, 7)) >= 0).all()


class _Model:
    """The same semantics, one Python dict entry per cached id."""

    def __init__(self, capacities: list[int], ends: list[int], policy: str, dim: int, dtype: torch.dtype) -> None:
        self.ends, self.policy, self.dim, self.dtype = ends, policy, dim, dtype
        starts = [sum(capacities[:p]) for p in range(len(capacities) + 1)]
        self.ranges = [range(starts[p], starts[p + 1]) for p in range(len(capacities))]
        self.rows: dict[int, dict] = {}  # id -> slot, value, version, validated, last, freq, grad, count, delta

    def slot(self, row: int) -> int:
        return self.rows[row]["slot"] if row in self.rows else -1

    def insert(self, ids: list[int], values: torch.Tensor, versions: list[int], step: int, protect: set[int]):
        by_slot = {r["slot"]: i for i, r in self.rows.items()}
        slots, dirty, evicted = [-1] * len(ids), [], []
        for p, slot_range in enumerate(self.ranges):
            mine = [k for k, i in enumerate(ids) if sum(i >= e for e in self.ends) == p]
            free = [s for s in slot_range if s not in by_slot]
            keyed = [(self._key(by_slot[s]), s) for s in slot_range if s in by_slot and s not in protect]
            for k, s in zip(mine, free + [s for _, s in sorted(keyed)]):
                if s in by_slot:
                    gone = self.rows.pop(by_slot[s])
                    evicted.append(by_slot[s])
                    if gone["count"]:
                        dirty.append((by_slot[s], gone["grad"], gone["count"]))
                zero = torch.zeros(self.dim, dtype=self.dtype)
                self.rows[ids[k]] = {
                    "slot": s,
                    "value": values[k].to(self.dtype),
                    "version": versions[k],
                    "validated": step,
                    "last": step,
                    "freq": 1,
                    "grad": zero,
                    "count": 0,
                    "delta": zero,
                }
                slots[k] = s
        return slots, dirty, evicted

    def _key(self, row: int) -> tuple[int, int]:
        r = self.rows[row]
        return (r["last"], r["freq"]) if self.policy == "lru" else (r["freq"], r["last"])

    def take_due(self, s_write: int) -> list[tuple[int, torch.Tensor, int]]:
        out = []
        for i in sorted(i for i, r in self.rows.items() if r["count"] > s_write):
            r = self.rows[i]
            out.append((i, r["grad"], r["count"]))
            r["grad"], r["count"], r["delta"] = torch.zeros_like(r["grad"]), 0, torch.zeros_like(r["delta"])
        return out


def _check_rows(got: PendingRows, want: list[tuple[int, torch.Tensor, int]], dim: int) -> None:
    order = torch.sort(got.ids).indices
    want = sorted(want, key=lambda t: t[0])
    assert got.ids[order].tolist() == [i for i, _, _ in want]
    assert got.counts[order].tolist() == [c for _, _, c in want]
    grads = torch.stack([g for _, g, _ in want]) if want else torch.empty(0, dim, dtype=got.grads.dtype)
    assert torch.allclose(got.grads[order], grads)


def _check_state(cache: RowCache, model: _Model) -> None:
    assert len(cache) == len(model.rows)
    ids = torch.tensor(sorted(model.rows), dtype=torch.int64)
    rows = [model.rows[i] for i in ids.tolist()]
    slots = cache.slots_of(ids)
    assert slots.tolist() == [r["slot"] for r in rows] and torch.equal(cache.slot_ids[slots], ids)
    for attr, key in (
        ("versions", "version"),
        ("validated_step", "validated"),
        ("last_used", "last"),
        ("frequency", "freq"),
        ("pending_count", "count"),
    ):
        assert getattr(cache, attr)[slots].tolist() == [r[key] for r in rows], attr
    if rows:
        assert torch.allclose(cache.values[slots], torch.stack([r["value"] for r in rows]))
        assert torch.allclose(cache.pending_delta[slots], torch.stack([r["delta"] for r in rows]))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "capacities, ends, candidates",
    [([6], [40], None), ([3, 5], [15, 40], None), ([30], [90], (1, 2)), ([9, 25, 14], [20, 70, 100], (1, 1))],
    ids=["one", "two", "few_candidates", "three_few_candidates"],
)
def test_random_workload_matches_the_model_and_loses_no_gradient(policy, dtype, capacities, ends, candidates) -> None:
    """Random reads, refreshes and writes under eviction pressure, step by step against the dict model.

    ``candidates``: (per victim, minimum) candidate slots a rescan keeps; small values make
    partitions run out of candidates and rescan often.
    """
    gen = torch.Generator().manual_seed(1234 + len(capacities))
    num_rows, dim = ends[-1], 3
    cache = RowCache(num_rows, dim, capacities if len(capacities) > 1 else capacities[0], policy, dtype, ends)
    if candidates is not None:
        cache.eviction.CANDIDATES_PER_VICTIM, cache.eviction.MIN_CANDIDATES = candidates
    model = _Model(capacities, ends, policy, dim, dtype)
    produced = torch.zeros(num_rows, dim, dtype=torch.float64)
    produced_count = torch.zeros(num_rows, dtype=torch.int64)
    returned: list[PendingRows] = []
    evictions = 0
    for step in range(300):
        n = int(torch.randint(1, 13, (1,), generator=gen))  # sometimes more distinct ids than slots
        ids = torch.unique(torch.randint(0, num_rows, (n,), generator=gen))
        ids = ids[torch.randperm(ids.numel(), generator=gen)]
        query = torch.cat([ids, ids[: ids.numel() // 2]])  # repeated ids
        assert cache.slots_of(query).tolist() == [model.slot(i) for i in query.tolist()]
        slots = cache.slots_of(ids)
        cached = slots >= 0
        refresh = cached & (torch.rand(ids.numel(), generator=gen) < 0.3)
        fresh_rows = torch.randn(int(refresh.sum()), dim, generator=gen, dtype=dtype)
        cache.refresh(slots[refresh], fresh_rows, torch.full_like(slots[refresh], step), step)
        for i, row in zip(ids[refresh].tolist(), fresh_rows):
            r = model.rows[i]
            r["value"], r["version"], r["validated"] = row + r["delta"], step, step
        validate = cached & ~refresh & (torch.rand(ids.numel(), generator=gen) < 0.3)
        cache.mark_validated(slots[validate], step)
        for i in ids[validate].tolist():
            model.rows[i]["validated"] = step

        missing = ids[~cached]
        rows = torch.randn(missing.numel(), dim, generator=gen, dtype=dtype)
        versions = torch.randint(0, 100, (missing.numel(),), generator=gen)
        if step % 2:  # as the lookup does it: shortfall read with its own data, slots first, rows later
            rescan = bool(cache.shortfall(missing, slots[cached]))
            new_slots, dirty, evicted = cache.reserve(
                missing, versions, step, slots[cached], check=False, rescan=rescan
            )
            cache.fill(new_slots, rows)
        else:
            new_slots, dirty, evicted = cache.insert(missing, rows, versions, step, protect=slots[cached])
        want_slots, want_dirty, want_evicted = model.insert(
            missing.tolist(), rows, versions.tolist(), step, set(slots[cached].tolist())
        )
        assert new_slots.tolist() == want_slots and sorted(evicted.tolist()) == sorted(want_evicted)
        _check_rows(dirty, want_dirty, dim)
        returned.append(dirty)
        evictions += evicted.numel()
        slots[~cached] = new_slots
        held = slots >= 0

        uses = torch.randint(1, 4, (int(held.sum()),), generator=gen)
        cache.touch(slots[held], step, uses)
        for i, u in zip(ids[held].tolist(), uses.tolist()):
            model.rows[i]["last"], model.rows[i]["freq"] = step, model.rows[i]["freq"] + u
        write = held & (torch.rand(ids.numel(), generator=gen) < 0.7)
        grads = torch.randn(int(write.sum()), dim, generator=gen, dtype=dtype)
        cache.accumulate(slots[write], grads, -0.1 * grads)
        for i, g in zip(ids[write].tolist(), grads):
            r = model.rows[i]
            r["grad"], r["count"] = r["grad"] + g, r["count"] + 1
            r["value"], r["delta"] = r["value"] - 0.1 * g, r["delta"] - 0.1 * g
        produced.index_add_(0, ids[write], grads.double())
        produced_count.index_add_(0, ids[write], torch.ones_like(ids[write]))

        s_write = int(torch.randint(0, 3, (1,), generator=gen))
        due = cache.take_due(s_write)
        assert torch.equal(due.ids, torch.sort(due.ids).values)  # ascending ids
        _check_rows(due, model.take_due(s_write), dim)
        returned.append(due)
        _check_state(cache, model)
        if step == 150:  # a flush and a reset halfway
            returned.append(cache.take_all())
            _check_rows(returned[-1], model.take_due(0), dim)
            cache.clear()
            model.rows.clear()
    returned.append(cache.take_all())
    back = PendingRows.concat(returned)
    got = torch.zeros(num_rows, dim, dtype=torch.float64).index_add_(0, back.ids, back.grads.double())
    got_count = torch.zeros(num_rows, dtype=torch.int64).index_add_(0, back.ids, back.counts)
    assert torch.allclose(got, produced, atol=1e-4)
    assert torch.equal(got_count, produced_count)
    assert evictions > 0 and sum(len(r) for r in returned[:-1]) > 0  # evictions and due pushes both happened


def test_ideal_lru_hits() -> None:
    steps = [_ids(1, 2), _ids(2, 3), _ids(1, 4), _ids(3)]
    # capacity 2: step1 miss 1,2; step2 hit 2, miss 3 (evict 1); step3 miss 1 (evict 2), miss 4 (evict 3); step4 miss 3
    assert lru_hits(steps, 2) == (1, 7)
    assert lru_hits(steps, 10) == (3, 7)
    assert lru_hits(steps, 10, counted_from=2) == (2, 3)
    assert lru_hits(steps, 0) == (0, 7)


def test_optimizer_state_comes_with_the_row_and_pending_squares_add_to_it() -> None:
    cache = RowCache(num_rows=10, dim=2, capacity=2)
    cache.hold_optimizer_state(1)
    assert cache.state_width == 1
    with pytest.raises(ValueError, match=r"optimizer state.*\[2, 1\]"):
        cache.insert(_ids(3, 5), _rows(2), _ids(0, 0), step=0)  # rows without their state
    slots, _, _ = cache.insert(_ids(3, 5), _rows(2), _ids(0, 0), step=0, states=torch.tensor([[1.0], [2.0]]))
    cache.accumulate(slots[:1], torch.ones(1, 2), torch.zeros(1, 2), squares=torch.tensor([[0.5]]))
    assert cache.known_states(slots).flatten().tolist() == [1.5, 2.0]
    cache.refresh(slots[:1], _rows(1), _ids(4), step=1, states=torch.tensor([[7.0]]))  # the owner's newer state
    assert cache.known_states(slots).flatten().tolist() == [7.5, 2.0]  # this rank's squares stay pending
    pushed = cache.take(slots[:1])
    assert pushed.squares.flatten().tolist() == [0.5] and cache.known_states(slots[:1]).flatten().tolist() == [7.0]
    cache.insert(_ids(8), _rows(1), _ids(0), step=2, states=torch.tensor([[9.0]]))  # evicts id 3 (LRU)
    assert cache.known_states(cache.slots_of(_ids(8))).flatten().tolist() == [9.0]


@pytest.mark.parametrize("state_width", [0, 1])
def test_write_through_is_accumulate_then_take_on_a_cache_with_nothing_pending(state_width) -> None:
    caches = [RowCache(num_rows=10, dim=2, capacity=4) for _ in range(2)]
    ids = _ids(7, 2, 5)
    for cache in caches:
        if state_width:
            cache.hold_optimizer_state(state_width)
        states = torch.ones(3, state_width) if state_width else None
        cache.insert(ids, _rows(3), _ids(0, 0, 0), step=0, states=states)
    slots = caches[0].slots_of(_ids(5, 7))  # not in id order: both return ascending ids
    grads, deltas = torch.tensor([[1.0, -2.0], [3.0, 0.5]]), torch.tensor([[-0.1, 0.2], [0.3, -0.4]])
    squares = grads[:, :1] ** 2 if state_width else None
    caches[0].accumulate(slots, grads, deltas, squares)
    taken = caches[0].take(slots)
    through = caches[1].write_through(slots, grads, deltas, squares)
    assert through.ids.tolist() == taken.ids.tolist() == [5, 7]
    assert torch.equal(through.grads, taken.grads) and torch.equal(through.counts, taken.counts)
    assert (through.squares is None) == (not state_width)
    if state_width:
        assert torch.equal(through.squares, taken.squares)
    assert torch.equal(caches[0].values, caches[1].values)  # the local update applied alike
    assert not caches[1].pending_count.any() and not caches[1].pending_grad.any()
    if state_width:
        with pytest.raises(ValueError, match="squares"):
            caches[1].write_through(slots, grads, deltas)
