"""Dense parameters that live inside a sharded embedding module (e.g. the position weights of
TorchRec's ``FeatureProcessedEmbeddingBagCollection``), reduced over ranks as DDP would.

Their gradients come out of the embedding backward, which the hybrid pipeline runs after
DDP's backward, so it averages them itself before the dense optimizer steps.

Design: docs/internals.md#hybrid-pipeline
"""

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class DenseParamsOfSparseModules:
    """The DDP-managed parameters of sharded modules, and the all-reduce DDP would give their gradients.

    Args:
        model: the model the pipeline trains (``DistributedModelParallel``).
        modules: the sharded modules the pipeline drives.
    """

    def __init__(self, model: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
        ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
        reduced = {id(p) for p in ddp.parameters()} if ddp is not None else set()
        self.group = ddp.process_group if ddp is not None else None
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self._ids: set[int] = set()
        for module in modules:
            sharded = set(module.sharded_parameter_names())
            for name, param in module.named_parameters():
                if name not in sharded and param.requires_grad and id(param) in reduced:
                    self.names.append(f"{type(module).__name__}.{name}")
                    self.params.append(param)
                    self._ids.add(id(param))

    def __bool__(self) -> bool:
        return bool(self.params)

    def read_as_of_now(self) -> AbstractContextManager:
        """For a lookup whose backward comes after dense steps: the autograd graph built in the block
        keeps a copy of each of these parameters it saves (the dense optimizer updates them in place
        before that backward), and every other saved tensor as is."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach().clone() if id(tensor) in self._ids else tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def all_reduce_grads(self) -> None:
        """Replaces each parameter's gradient by its mean over the ranks (zeros where a rank has none):
        one collective, issued by every rank in the same order."""
        if not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        for param, mean in zip(self.params, flat.split([p.numel() for p in self.params])):
            if param.grad is None:
                param.grad = mean.view_as(param).clone()
            else:
                param.grad.copy_(mean.view_as(param))
