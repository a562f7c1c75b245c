"""Routes DDP's gradient-bucket all-reduce through ``dist.all_reduce`` so it can be counted.

DDP's reducer all-reduces gradient buckets in C++, out of reach of the
``torch.distributed`` wrappers. :func:`attach_ddp_hooks` registers a comm hook
that does the same work from Python -- scale each bucket by the world size,
then sum it with ``dist.all_reduce`` -- under the ``dense_allreduce`` phase, or
under ``bwd_grad`` for the DDP that TorchRec wraps around the lookup of
data_parallel embedding tables (their gradients are embedding traffic).

The scaling repeats the reducer's own arithmetic so that training stays
bit-for-bit the same as without a hook: a gradient that DDP copies into its
bucket is multiplied by ``1/world_size``; a gradient that already lives in the
bucket (``gradient_as_bucket_view=True`` with gradients zeroed in place, as
TorchRec's ``CombinedOptimizer.zero_grad()`` does) is divided by
``world_size``. The two differ in the last bit for world sizes that are not
powers of two, which is also why ``ddp_comm_hooks.default_hooks.allreduce_hook``
(always divides) is not used. A tensor hook on every parameter notes, before
each backward accumulates into ``.grad``, which of the two cases applies.
"""

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_types import BaseEmbeddingLookup

from torchrec_het_bench.comm.phases import phase

_NOT_SEEN = object()


@dataclass
class CountedHookState:
    """State of :func:`counted_allreduce_hook` for one DDP module.

    Attributes:
        process_group: DDP's process group; the default group when ``None``.
        phase_name: the phase its all-reduce counts under: ``dense_allreduce``
            for the dense network, ``bwd_grad`` for the gradients of
            data_parallel embedding tables (DDP around an embedding lookup).
        grad_before: ``id(param) -> data_ptr`` of the parameter's ``.grad`` just
            before the current backward accumulated into it (``None`` if it had
            none); consumed by the comm hook.
    """

    process_group: dist.ProcessGroup | None
    phase_name: str = "dense_allreduce"
    grad_before: dict[int, int | None] = field(default_factory=dict)


def _scale_like_reducer(
    param: torch.Tensor, bucket_grad: torch.Tensor, state: CountedHookState, world_size: int
) -> None:
    before = state.grad_before.pop(id(param), _NOT_SEEN)
    if before is _NOT_SEEN:  # no gradient this backward: DDP reuses whatever .grad holds
        if param.grad is None:
            return
        before = param.grad.data_ptr()
    if before is not None and before == bucket_grad.data_ptr():
        bucket_grad.div_(world_size)  # the gradient already lived in the bucket
    else:
        bucket_grad.mul_(1.0 / world_size)  # DDP copied it into the bucket


def counted_allreduce_hook(state: CountedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: DDP's default averaging all-reduce, issued through ``dist.all_reduce``.

    Args:
        state: the DDP module's :class:`CountedHookState`.
        bucket: the gradient bucket DDP hands over.

    Returns:
        A future holding the averaged bucket.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    for param, bucket_grad in zip(bucket.parameters(), bucket.gradients()):
        _scale_like_reducer(param, bucket_grad, state, world_size)
    with phase(state.phase_name):
        work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _remember_grad_before_accumulation(param: torch.Tensor, state: CountedHookState) -> None:
    param_ref = weakref.ref(param)

    def remember(_: torch.Tensor) -> None:  # a leaf's tensor hook runs before AccumulateGrad
        owner = param_ref()
        if owner is not None:
            state.grad_before[id(owner)] = None if owner.grad is None else owner.grad.data_ptr()

    param.register_hook(remember)


def _children_including_hidden(module: nn.Module) -> Iterator[nn.Module]:
    yield from (child for child in module._modules.values() if child is not None)
    # Sharded modules keep their lookups in plain lists (``ShardedEmbeddingBagCollection._lookups``),
    # and wrap data_parallel tables' lookups in DDP there.
    for value in vars(module).values():
        if isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, nn.Module))


def _modules_including_hidden(root: nn.Module) -> Iterator[nn.Module]:
    # Walks the raw ``_modules`` dicts and module lists kept as plain attributes:
    # DistributedModelParallel hides its ``_dmp_wrapped_module`` (where DDP lives)
    # from named_modules(), TorchRec's sharded modules their lookups.
    seen: set[int] = set()
    pending = [root]
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        pending.extend(_children_including_hidden(module))


def _existing_hook_name(ddp: DistributedDataParallel) -> str | None:
    if ddp._comm_hooks:
        hook, _ = ddp._comm_hooks[-1]
        return getattr(hook, "__qualname__", repr(hook))
    logged = ddp._get_ddp_logging_data().get("comm_hook")
    return logged or None


def _needs_hook(ddp: DistributedDataParallel) -> bool:
    existing = _existing_hook_name(ddp)
    if existing == counted_allreduce_hook.__qualname__:
        return False
    if existing is not None:
        raise RuntimeError(
            f"DDP module already has the comm hook {existing!r}; DDP allows one hook, so its "
            "all-reduce cannot be routed through the counting hook"
        )
    if getattr(ddp, "_lazy_init_ran", False):
        raise RuntimeError("attach_ddp_hooks must be called before the first forward of the model")
    return True


def attach_ddp_hooks(model: nn.Module) -> int:
    """Registers :func:`counted_allreduce_hook` on every DDP module inside ``model``.

    Finds ``DistributedDataParallel`` modules anywhere in the module tree,
    including the one ``DistributedModelParallel`` keeps at
    ``_dmp_wrapped_module`` and those that wrap data_parallel tables' lookups
    inside sharded embedding modules. DDP modules that already carry this hook are left
    alone, so calling it twice is harmless.

    Args:
        model: the model, before its first forward.

    Returns:
        How many DDP modules got the hook now.

    Raises:
        RuntimeError: a DDP module already has another comm hook, or has run forward.
    """
    ddps = [m for m in _modules_including_hidden(model) if isinstance(m, DistributedDataParallel)]
    to_hook = [ddp for ddp in ddps if _needs_hook(ddp)]  # checks all before hooking any
    for ddp in to_hook:
        embedding = isinstance(ddp.module, BaseEmbeddingLookup)
        state = CountedHookState(ddp.process_group, "bwd_grad" if embedding else "dense_allreduce")
        for name, param in ddp.module.named_parameters():
            if param.requires_grad and name not in ddp.parameters_to_ignore:
                _remember_grad_before_accumulation(param, state)
        ddp.register_comm_hook(state, counted_allreduce_hook)
    return len(to_hook)
