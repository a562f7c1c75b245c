"""Rank bodies for tests/distributed/test_comm_accounting.py.

:func:`run_world` is the ``torch.multiprocessing.spawn`` target: it joins a gloo
group, runs every check of :data:`CHECKS` in order and writes what the rank
observed to ``<out_dir>/rank<r>.json``. The checks only observe (counted bytes,
facts about the data and the plan); the test computes the expected bytes by
hand and compares. An exception in a check kills the rank, and spawn reports it.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchrec_het_bench.comm import CommAccountant, CommTotals, attach_ddp_hooks, phase, sum_over_ranks
from torchrec_het_bench.comm.accounting import WRAPPED_NAMES
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

Observation = dict


def _entries(totals: CommTotals, rank: int) -> list[dict]:
    """This rank's counted rows, one per (phase, family)."""
    return [
        {"phase": p, "family": f, "sends": rows[rank], "calls": totals.calls[(p, f)]}
        for (p, f), rows in sorted(totals.traffic.items())
    ]


def _phase_rows(totals: CommTotals, rank: int) -> dict[str, list[int]]:
    return {p: totals.matrix(p)[rank] for p in sorted({p for p, _ in totals.traffic})}


# --- every wrapped collective, sync and async -------------------------------------------


def _case_all_to_all_single(rank: int, ws: int, async_op: bool):
    splits_in = [rank + j + 1 for j in range(ws)]
    splits_out = [j + rank + 1 for j in range(ws)]  # rank j sends us j + rank + 1 rows
    out = torch.empty(sum(splits_out), 3)
    source = torch.full((sum(splits_in), 3), float(rank))
    work = dist.all_to_all_single(out, source, splits_out, splits_in, async_op=async_op)
    expected = torch.cat([torch.full((n, 3), float(j)) for j, n in enumerate(splits_out)])
    return work, lambda: torch.equal(out, expected)


def _case_all_to_all_single_equal(rank: int, ws: int, async_op: bool):
    out = torch.empty(2 * ws, dtype=torch.int64)
    work = dist.all_to_all_single(out, torch.full((2 * ws,), rank, dtype=torch.int64), async_op=async_op)
    expected = torch.arange(ws).repeat_interleave(2)
    return work, lambda: torch.equal(out, expected)


def _case_all_to_all(rank: int, ws: int, async_op: bool):
    # gloo's list all_to_all needs equal chunks; uneven ones are covered by the unit tests.
    inputs = [torch.full((2,), float(rank), dtype=torch.float64) for _ in range(ws)]
    outputs = [torch.empty(2, dtype=torch.float64) for _ in range(ws)]
    work = dist.all_to_all(outputs, inputs, async_op=async_op)
    return work, lambda: all(torch.equal(o, torch.full_like(o, float(j))) for j, o in enumerate(outputs))


def _case_reduce_scatter(rank: int, ws: int, async_op: bool):
    inputs = [torch.full((j + 1,), float(rank + 1)) for j in range(ws)]
    out = torch.empty(rank + 1)
    work = dist.reduce_scatter(out, inputs, async_op=async_op)
    return work, lambda: torch.equal(out, torch.full_like(out, ws * (ws + 1) / 2))


def _reduce_scatter_tensor_case(name: str):
    def case(rank: int, ws: int, async_op: bool):
        out = torch.empty(2, 5)
        work = getattr(dist, name)(out, torch.ones(2 * ws, 5), async_op=async_op)
        return work, lambda: torch.equal(out, torch.full_like(out, float(ws)))

    return case


def _case_all_gather(rank: int, ws: int, async_op: bool):
    outputs = [torch.empty(3) for _ in range(ws)]
    work = dist.all_gather(outputs, torch.full((3,), float(rank)), async_op=async_op)
    return work, lambda: all(torch.equal(o, torch.full_like(o, float(j))) for j, o in enumerate(outputs))


def _all_gather_tensor_case(name: str):
    def case(rank: int, ws: int, async_op: bool):
        out = torch.empty(4 * ws, dtype=torch.int32)
        work = getattr(dist, name)(out, torch.full((4,), rank, dtype=torch.int32), async_op=async_op)
        return work, lambda: torch.equal(out, torch.arange(ws, dtype=torch.int32).repeat_interleave(4))

    return case


def _case_all_reduce(rank: int, ws: int, async_op: bool):
    tensor = torch.full((10,), float(rank))
    work = dist.all_reduce(tensor, async_op=async_op)
    return work, lambda: torch.equal(tensor, torch.full_like(tensor, ws * (ws - 1) / 2))


def _case_broadcast(rank: int, ws: int, async_op: bool):
    tensor = torch.full((6,), float(rank), dtype=torch.float64)
    work = dist.broadcast(tensor, src=1, async_op=async_op)
    return work, lambda: torch.equal(tensor, torch.ones_like(tensor))


COLLECTIVE_CASES: dict[str, Callable] = {
    "all_to_all_single": _case_all_to_all_single,
    "all_to_all_single_equal": _case_all_to_all_single_equal,
    "all_to_all": _case_all_to_all,
    "reduce_scatter": _case_reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor_case("reduce_scatter_tensor"),
    "reduce_scatter_single": _reduce_scatter_tensor_case("reduce_scatter_single"),
    "_reduce_scatter_base": _reduce_scatter_tensor_case("_reduce_scatter_base"),
    "all_gather": _case_all_gather,
    "all_gather_into_tensor": _all_gather_tensor_case("all_gather_into_tensor"),
    "all_gather_single": _all_gather_tensor_case("all_gather_single"),
    "_all_gather_base": _all_gather_tensor_case("_all_gather_base"),
    "all_reduce": _case_all_reduce,
    "broadcast": _case_broadcast,
}


def check_collectives(rank: int, ws: int) -> Observation:
    """Each collective once synchronously and once with ``async_op=True``."""
    observed = {}
    with CommAccountant() as accountant:
        for name, case in COLLECTIVE_CASES.items():
            for async_op in (False, True):
                accountant.reset()
                work, result_is_right = case(rank, ws, async_op)
                returned = "work" if isinstance(work, dist.Work) else repr(work)
                if async_op:
                    work.wait()
                observed[f"{name}/{'async' if async_op else 'sync'}"] = {
                    "entries": _entries(accountant.totals(), rank),
                    "returned": returned,
                    "result_right": result_is_right(),
                }
    return observed


# --- process subgroups: group ranks map to global ranks ---------------------------------


def check_groups(rank: int, ws: int) -> Observation:
    """Collectives on a subgroup of global ranks 1..ws-1; rank 0 is not a member."""
    members = list(range(1, ws))
    group = dist.new_group(ranks=members)
    observed: dict = {}
    with CommAccountant() as accountant:
        if rank not in members:
            dist.all_reduce(torch.ones(4), group=group)  # torch warns and does nothing
            return {"outsider": _entries(accountant.totals(), rank)}
        me, size = members.index(rank), len(members)
        calls = {
            "all_gather": lambda: dist.all_gather([torch.empty(2) for _ in members], torch.ones(2), group=group),
            "all_to_all_single": lambda: dist.all_to_all_single(
                torch.empty(sum(j + me + 1 for j in range(size)), dtype=torch.int64),
                torch.zeros(sum(me + j + 1 for j in range(size)), dtype=torch.int64),
                [j + me + 1 for j in range(size)],
                [me + j + 1 for j in range(size)],
                group=group,
            ),
            "broadcast_group_src": lambda: dist.broadcast(torch.ones(3), group=group, group_src=size - 1),
            "broadcast_src": lambda: dist.broadcast(torch.ones(3), src=ws - 1, group=group),
        }
        for name, call in calls.items():
            accountant.reset()
            call()
            observed[name] = _entries(accountant.totals(), rank)
    return observed


# --- install/uninstall, transparency of errors, pausing ---------------------------------


def _error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 -- compared as text
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_install(rank: int, ws: int) -> Observation:
    """Wrappers go in and come out exactly; errors and return values pass through."""
    originals = {name: getattr(dist, name) for name in WRAPPED_NAMES}
    bad_calls = {
        "all_reduce_list": lambda: dist.all_reduce([1.0, 2.0]),
        "broadcast_no_src": lambda: dist.broadcast(torch.ones(2)),
    }
    plain_errors = {name: _error_of(call) for name, call in bad_calls.items()}
    accountant = CommAccountant()
    with accountant:
        replaced = all(getattr(dist, n) is not originals[n] for n in WRAPPED_NAMES)
        wraps_original = all(getattr(dist, n).__wrapped__ is originals[n] for n in WRAPPED_NAMES)
        names_kept = all(getattr(dist, n).__name__ == originals[n].__name__ for n in WRAPPED_NAMES)
        with accountant:
            pass
        still_installed_after_nested_exit = accountant.installed
        second_error = _error_of(lambda: CommAccountant().__enter__())
        wrapped_errors = {name: _error_of(call) for name, call in bad_calls.items()}
        counted_after_errors = accountant.totals().call_count()
        accountant.enabled = False
        dist.all_reduce(torch.ones(8))
        counted_while_paused = accountant.totals().call_count()
        accountant.enabled = True
    restored_after_exit = all(getattr(dist, n) is originals[n] for n in WRAPPED_NAMES)
    raised_inside = _error_of(lambda: _raise_inside(CommAccountant()))
    return {
        "replaced": replaced,
        "wraps_original": wraps_original,
        "names_kept": names_kept,
        "still_installed_after_nested_exit": still_installed_after_nested_exit,
        "second_accountant_error": second_error,
        "plain_errors": plain_errors,
        "wrapped_errors": wrapped_errors,
        "counted_after_errors": counted_after_errors,
        "counted_while_paused": counted_while_paused,
        "restored_after_exit": restored_after_exit,
        "raised_inside": raised_inside,
        "restored_after_error": all(getattr(dist, n) is originals[n] for n in WRAPPED_NAMES),
    }


def _raise_inside(accountant: CommAccountant) -> None:
    with accountant:
        raise KeyError("inside")


# --- phase rules ------------------------------------------------------------------------


class _AllReduceInBackward(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient, optionally under a phase override."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, override: str | None) -> torch.Tensor:
        ctx.override = override
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        if ctx.override is None:
            dist.all_reduce(grad)
        else:
            with phase(ctx.override):
                dist.all_reduce(grad)
        return grad, None


def input_dist(tensor: torch.Tensor) -> None:
    """Named like TorchRec's input-dist methods, so its float collective is counted as ids."""
    dist.all_reduce(tensor)


def _phase_of(accountant: CommAccountant, call: Callable[[], object]) -> list[str]:
    accountant.reset()
    call()
    return sorted({p for p, _ in accountant.totals().traffic})


def check_phases(rank: int, ws: int) -> Observation:
    """Overrides, backward, input_dist frames, dtypes; sum_over_ranks counts nothing."""

    def backward(override: str | None) -> None:
        leaf = torch.ones(4, requires_grad=True)
        _AllReduceInBackward.apply(leaf, override).sum().backward()

    def overridden(name: str, call: Callable[[], object]) -> Callable[[], object]:
        def run() -> None:
            with phase(name):
                call()

        return run

    def nested() -> None:
        with phase("other"), phase("fwd_ids"):
            dist.all_reduce(torch.ones(4))

    with CommAccountant() as accountant:
        observed = {
            "float": _phase_of(accountant, lambda: dist.all_reduce(torch.ones(4))),
            "int": _phase_of(accountant, lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64))),
            "int32": _phase_of(accountant, lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32))),
            "override_float": _phase_of(accountant, overridden("other", lambda: dist.all_reduce(torch.ones(4)))),
            "override_int": _phase_of(
                accountant, overridden("other", lambda: dist.all_to_all_single(torch.empty(ws), torch.ones(ws)))
            ),
            "nested_override": _phase_of(accountant, nested),
            "backward": _phase_of(accountant, lambda: backward(None)),
            "backward_override": _phase_of(accountant, lambda: backward("other")),
            "input_dist_float": _phase_of(accountant, lambda: input_dist(torch.ones(4))),
            "unknown_phase_error": _error_of(lambda: phase("embeddings").__enter__()),
        }
        accountant.reset()
        splits_in, splits_out = [rank + j + 1 for j in range(ws)], [j + rank + 1 for j in range(ws)]
        dist.all_to_all_single(torch.empty(sum(splits_out)), torch.ones(sum(splits_in)), splits_out, splits_in)
        own = accountant.totals()
        summed = sum_over_ranks(own)
        observed["own_summary"] = own.summary()
        observed["summed_summary"] = summed.summary()
        observed["summed_matrix"] = summed.matrix()
        observed["counted_by_sum_over_ranks"] = accountant.totals().call_count() - own.call_count()
    return observed


# --- DDP: bucket bytes and identical training -------------------------------------------

DDP_STEPS = 3


def _dense_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1, bias=False))  # 24 parameters


DDP_VARIANTS = tuple((view, to_none) for view in (False, True) for to_none in (True, False))


def _train_ddp(
    rank: int, hooked: bool, bucket_view: bool, set_to_none: bool, accountant: CommAccountant
) -> list[torch.Tensor]:
    ddp = nn.parallel.DistributedDataParallel(_dense_net(), gradient_as_bucket_view=bucket_view)
    if hooked:
        attach_ddp_hooks(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    accountant.reset()
    for _ in range(DDP_STEPS):
        ddp(torch.randn(5, 4, generator=generator)).square().sum().backward()
        optimizer.step()
        last_grads = [p.grad.clone() for p in ddp.parameters()]
        optimizer.zero_grad(set_to_none=set_to_none)
    return [p.detach().clone() for p in ddp.parameters()] + last_grads


def check_ddp(rank: int, ws: int) -> Observation:
    """Hooked DDP trains exactly as unhooked DDP; its buckets count as dense_allreduce."""
    observed: dict = {}
    with CommAccountant() as accountant:
        for bucket_view, set_to_none in DDP_VARIANTS:
            plain = _train_ddp(rank, False, bucket_view, set_to_none, accountant)
            plain_totals = accountant.totals()
            hooked = _train_ddp(rank, True, bucket_view, set_to_none, accountant)
            observed[f"bucket_view={bucket_view},set_to_none={set_to_none}"] = {
                "identical": all(torch.equal(a, b) for a, b in zip(plain, hooked)),
                "unhooked_calls": plain_totals.call_count(),
                "hooked": _entries(accountant.totals(), rank),
            }
    ddp = nn.parallel.DistributedDataParallel(_dense_net())
    observed["first_attach"] = attach_ddp_hooks(nn.Sequential(ddp))
    observed["second_attach"] = attach_ddp_hooks(ddp)
    foreign = nn.parallel.DistributedDataParallel(_dense_net())
    foreign.register_comm_hook(None, _noop_hook)
    observed["foreign_hook_error"] = _error_of(lambda: attach_ddp_hooks(foreign))
    late = nn.parallel.DistributedDataParallel(_dense_net())
    late(torch.ones(1, 4)).sum().backward()
    observed["after_forward_error"] = _error_of(lambda: attach_ddp_hooks(late))
    return observed


def _noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# --- one real TorchRec step -------------------------------------------------------------

BATCH_SIZE = 4
TABLES = (("t0", "f0", 4, 20), ("t1", "f1", 8, 30), ("t2", "f2", 4, 10))  # name, feature, dim, rows
DENSE_OUT = 3  # the dense layer has sum(dims) x 3 = 48 weights


class _TinyRecModel(nn.Module):
    def __init__(self, weighted: bool) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        configs = [
            EmbeddingBagConfig(name=n, feature_names=[f], embedding_dim=d, num_embeddings=r) for n, f, d, r in TABLES
        ]
        self.ebc = EmbeddingBagCollection(configs, is_weighted=weighted, device=torch.device("meta"))
        torch.manual_seed(0)
        self.dense = nn.Linear(sum(d for _, _, d, _ in TABLES), DENSE_OUT, bias=False)

    def forward(self, features) -> torch.Tensor:
        return self.dense(self.ebc(features).values()).square().sum()


def _batch(rank: int, step: int, weighted: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(1000 * rank + step)
    lengths = torch.randint(0, 4, (len(TABLES) * BATCH_SIZE,), generator=generator, dtype=torch.int32)
    ids = [
        torch.randint(0, rows, (int(n),), generator=generator)
        for (_, _, _, rows), n in zip(TABLES, lengths.view(len(TABLES), BATCH_SIZE).sum(1))
    ]
    values = torch.cat(ids)
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f for _, f, _, _ in TABLES], values=values, lengths=lengths, weights=weights
    )
    return features, {f: t.tolist() for (_, f, _, _), t in zip(TABLES, ids)}


def _shard(sharding_type: str, weighted: bool):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_het.sharders.row_wise import CpuRowWiseEmbeddingBagCollectionSharder

    row_wise = sharding_type == "row_wise"
    sharder = CpuRowWiseEmbeddingBagCollectionSharder() if row_wise else EmbeddingBagCollectionSharder()
    model = _TinyRecModel(weighted)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        batch_size=BATCH_SIZE,
        constraints={n: ParameterConstraints(sharding_types=[sharding_type]) for n, _, _, _ in TABLES},
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return dmp, plan.plan["ebc"]


def _table_facts(module_plan) -> list[dict]:
    facts = []
    for name, feature, dim, rows in TABLES:
        sharding = module_plan[name]
        shards = [
            {"rank": s.placement.rank(), "row_offset": s.shard_offsets[0], "rows": s.shard_sizes[0]}
            for s in sharding.sharding_spec.shards
        ]
        facts.append(
            {
                "name": name,
                "feature": feature,
                "dim": dim,
                "rows": rows,
                "sharding_type": sharding.sharding_type,
                "shards": shards,
            }
        )
    return facts


def _torchrec_step(rank: int, sharding_type: str, weighted: bool) -> Observation:
    dmp, module_plan = _shard(sharding_type, weighted)
    hooked = attach_ddp_hooks(dmp)
    dense = [p for n, p in dmp.named_parameters() if "dense" in n]
    optimizer = torch.optim.SGD(dense, lr=0.01)
    with CommAccountant() as accountant:
        for step in range(2):  # the second step is the one observed
            accountant.reset()
            features, ids = _batch(rank, step, weighted)
            dmp(features).backward()
            optimizer.step()
            optimizer.zero_grad()
        totals = accountant.totals()
    return {
        "ddp_hooked": hooked,
        "tables": _table_facts(module_plan),
        "ids": ids,
        "lengths_itemsize": features.lengths().element_size(),
        "values_itemsize": features.values().element_size(),
        "weights_itemsize": features.weights().element_size() if weighted else 0,
        "dense_params": sum(p.numel() for p in dense),
        "phase_rows": _phase_rows(totals, rank),
        "summary": totals.summary(),
        "entries": _entries(totals, rank),
    }


def check_torchrec_table_wise(rank: int, ws: int) -> Observation:
    """A weighted EBC, every table table-wise: ids, lengths and weights go by all_to_all."""
    return _torchrec_step(rank, "table_wise", weighted=True)


def check_torchrec_row_wise(rank: int, ws: int) -> Observation:
    """An unweighted EBC, every table row-wise: pooled partial sums go by reduce_scatter."""
    return _torchrec_step(rank, "row_wise", weighted=False)


CHECKS: dict[str, Callable[[int, int], Observation]] = {
    "install": check_install,
    "collectives": check_collectives,
    "groups": check_groups,
    "phases": check_phases,
    "ddp": check_ddp,
    "torchrec_table_wise": check_torchrec_table_wise,
    "torchrec_row_wise": check_torchrec_row_wise,
}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: joins a gloo group on ``port``, runs :data:`CHECKS`, writes ``rank<r>.json``."""
    observed = {}
    with gloo_rank(rank, world_size, port):
        for name, check in CHECKS.items():
            observed[name] = check(rank, world_size)
            dist.barrier()
    write_rank_result(out_dir, rank, observed)
