"""RowCache: slots, eviction policies, read-your-writes, due pushes, and no gradient lost."""

import pytest
import torch

from torchrec_het.cache import PendingRows, RowCache
from torchrec_het.cache.ideal import lru_hits


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _rows(n: int, dim: int = 2, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * dim, dtype=torch.float32).view(n, dim) + start


def test_insert_and_find() -> None:
    cache = RowCache(num_rows=10, dim=2, capacity=3)
    slots, dirty, evicted = cache.insert(_ids(4, 7), _rows(2), _ids(5, 6), step=1)
    assert slots.tolist() == [0, 1] and len(dirty) == 0 and evicted.numel() == 0
    assert cache.slots_of(_ids(7, 4, 3, 7)).tolist() == [1, 0, -1, 1]
    assert len(cache) == 2
    assert cache.versions[slots].tolist() == [5, 6] and cache.validated_step[slots].tolist() == [1, 1]
    assert torch.equal(cache.values[slots], _rows(2))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="policy"):
        RowCache(10, 2, 3, policy="fifo")
    with pytest.raises(ValueError, match="capacity"):
        RowCache(10, 2, -1)
    cache = RowCache(10, 2, 3)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        cache.slots_of(_ids(10))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        cache.slots_of(_ids(-1))
    cache.insert(_ids(1), _rows(1), _ids(0), step=0)
    with pytest.raises(ValueError, match="not cached yet"):
        cache.insert(_ids(1), _rows(1), _ids(0), step=0)
    with pytest.raises(ValueError, match="distinct"):
        cache.insert(_ids(2, 2), _rows(2), _ids(0, 0), step=0)


def test_capacity_zero_caches_nothing() -> None:
    cache = RowCache(10, 2, 0)
    slots, dirty, evicted = cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=0)
    assert slots.tolist() == [-1, -1] and len(dirty) == 0 and evicted.numel() == 0 and len(cache) == 0


def test_lru_and_lfu_choose_different_victims() -> None:
    for policy, victim in (("lru", 1), ("lfu", 2)):
        cache = RowCache(10, 2, 2, policy=policy)
        cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=0)
        cache.touch(cache.slots_of(_ids(1)), step=1, uses=_ids(5))  # row 1: used often, long ago
        cache.touch(cache.slots_of(_ids(2)), step=3)  # row 2: used once, recently
        cache.insert(_ids(3), _rows(1), _ids(0), step=4)
        assert cache.slots_of(_ids(victim)).item() == -1, policy
        assert len(cache) == 2


def test_protected_slots_survive_and_overflow_gets_no_slot() -> None:
    cache = RowCache(10, 2, 2)
    cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=0)
    protect = cache.slots_of(_ids(1, 2))
    slots, _, evicted = cache.insert(_ids(3, 4), _rows(2), _ids(0, 0), step=1, protect=protect)
    assert slots.tolist() == [-1, -1] and evicted.numel() == 0
    assert (cache.slots_of(_ids(1, 2)) >= 0).all()
    slots, _, evicted = cache.insert(_ids(3, 4, 5), _rows(3), _ids(0, 0, 0), step=2, protect=cache.slots_of(_ids(2)))
    assert (slots >= 0).tolist() == [True, False, False] and evicted.numel() == 1
    assert cache.slots_of(_ids(1)).item() == -1


def test_dirty_eviction_returns_its_pending_mass() -> None:
    cache = RowCache(10, 2, 1)
    slots, _, _ = cache.insert(_ids(6), _rows(1), _ids(0), step=0)
    cache.accumulate(slots, torch.ones(1, 2), torch.zeros(1, 2))
    cache.accumulate(slots, 2 * torch.ones(1, 2), torch.zeros(1, 2))
    _, dirty, evicted = cache.insert(_ids(7), _rows(1), _ids(0), step=1)
    assert evicted.numel() == 1 and dirty.ids.tolist() == [6] and dirty.counts.tolist() == [2]
    assert torch.equal(dirty.grads, 3 * torch.ones(1, 2))
    _, dirty, evicted = cache.insert(_ids(8), _rows(1), _ids(0), step=2)  # row 7 was clean
    assert evicted.numel() == 1 and len(dirty) == 0


def test_read_your_writes_survives_a_refresh() -> None:
    cache = RowCache(10, 2, 2)
    slots, _, _ = cache.insert(_ids(3), torch.zeros(1, 2), _ids(0), step=0)
    cache.accumulate(slots, torch.ones(1, 2), torch.full((1, 2), -0.5))
    assert torch.equal(cache.values[slots], torch.full((1, 2), -0.5))
    cache.refresh(slots, torch.full((1, 2), 10.0), _ids(4), step=3)
    assert torch.equal(cache.values[slots], torch.full((1, 2), 9.5))  # owner value + own unpushed update
    assert cache.versions[slots].item() == 4 and cache.validated_step[slots].item() == 3
    due = cache.take_all()
    assert due.ids.tolist() == [3] and torch.equal(due.grads, torch.ones(1, 2))
    cache.refresh(slots, torch.full((1, 2), 10.0), _ids(5), step=4)
    assert torch.equal(cache.values[slots], torch.full((1, 2), 10.0))  # pushed: nothing left to re-apply


def test_take_due_is_strictly_above_the_bound() -> None:
    cache = RowCache(10, 2, 3)
    slots, _, _ = cache.insert(_ids(5, 1, 3), _rows(3), _ids(0, 0, 0), step=0)
    cache.accumulate(slots, torch.ones(3, 2), torch.zeros(3, 2))
    cache.accumulate(slots[:1], torch.ones(1, 2), torch.zeros(1, 2))
    assert cache.take_due(1).ids.tolist() == [5]  # two updates > 1
    assert cache.take_due(0).ids.tolist() == [1, 3]  # ascending ids
    assert len(cache.take_all()) == 0


def test_clear_forgets_everything() -> None:
    cache = RowCache(10, 2, 2)
    slots, _, _ = cache.insert(_ids(1, 2), _rows(2), _ids(0, 0), step=0)
    cache.accumulate(slots, torch.ones(2, 2), torch.zeros(2, 2))
    cache.clear()
    assert len(cache) == 0 and (cache.slots_of(_ids(1, 2)) == -1).all() and len(cache.take_all()) == 0
    assert cache.nbytes() > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_workload_loses_no_gradient(policy: str, dtype: torch.dtype) -> None:
    """Random reads and writes under eviction pressure: every gradient comes back exactly once."""
    generator = torch.Generator().manual_seed(0)
    num_rows, dim, s_write = 40, 3, 2
    cache = RowCache(num_rows, dim, capacity=6, policy=policy, dtype=dtype)
    produced = torch.zeros(num_rows, dim, dtype=torch.float64)
    produced_count = torch.zeros(num_rows, dtype=torch.int64)
    returned: list[PendingRows] = []
    for step in range(300):
        ids = torch.unique(torch.randint(0, num_rows, (8,), generator=generator))
        slots = cache.slots_of(ids)
        missing = ids[slots < 0]
        new_slots, dirty, _ = cache.insert(missing, torch.zeros(missing.numel(), dim), torch.zeros_like(missing), step, protect=slots[slots >= 0])
        returned.append(dirty)
        slots[slots < 0] = new_slots
        assert len(cache) <= 6
        cached = slots >= 0
        assert torch.equal(cache.slot_ids[slots[cached]], ids[cached])  # slots hold what slots_of says
        grads = torch.randn(int(cached.sum()), dim, generator=generator, dtype=dtype)
        cache.accumulate(slots[cached], grads, torch.zeros_like(grads))
        produced.index_add_(0, ids[cached], grads.double())
        produced_count.index_add_(0, ids[cached], torch.ones_like(ids[cached]))
        returned.append(cache.take_due(s_write))
    returned.append(cache.take_all())
    back = PendingRows.concat(returned)
    got = torch.zeros(num_rows, dim, dtype=torch.float64).index_add_(0, back.ids, back.grads.double())
    got_count = torch.zeros(num_rows, dtype=torch.int64).index_add_(0, back.ids, back.counts)
    assert torch.allclose(got, produced, atol=1e-5)
    assert torch.equal(got_count, produced_count)
    assert sum(len(r) for r in returned[:-1]) > 0  # evictions and due pushes both happened


def test_ideal_lru_hits() -> None:
    steps = [_ids(1, 2), _ids(2, 3), _ids(1, 4), _ids(3)]
    # capacity 2: step1 miss 1,2; step2 hit 2, miss 3 (evict 1); step3 miss 1 (evict 2), miss 4 (evict 3); step4 miss 3
    assert lru_hits(steps, 2) == (1, 7)
    assert lru_hits(steps, 10) == (3, 7)
    assert lru_hits(steps, 10, counted_from=2) == (2, 3)
    assert lru_hits(steps, 0) == (0, 7)


def test_partitions_keep_their_own_capacity() -> None:
    # ids 0..4 are table A (1 slot), ids 5..9 table B (2 slots)
    cache = RowCache(10, 2, capacity=[1, 2], partition_ends=[5, 10])
    slots, _, evicted = cache.insert(_ids(1, 2, 6, 7, 8), _rows(5), _ids(0, 0, 0, 0, 0), step=0)
    assert (slots >= 0).tolist() == [True, False, True, True, False] and evicted.numel() == 0
    assert cache.partition_of(_ids(4, 5)).tolist() == [0, 1]
    slots, _, evicted = cache.insert(_ids(3), _rows(1), _ids(0), step=1)  # evicts row 1, never a B row
    assert slots.item() >= 0 and evicted.numel() == 1
    assert cache.slots_of(_ids(1)).item() == -1 and (cache.slots_of(_ids(6, 7)) >= 0).all()
    with pytest.raises(ValueError, match="partition_ends"):
        RowCache(10, 2, capacity=[1, 2], partition_ends=[5])
