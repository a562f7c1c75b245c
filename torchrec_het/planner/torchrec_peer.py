"""The plugin planner's peer: the plan TorchRec's own planner makes with the stock types of the same
sharders (the topology as given, TorchRec's estimators): what the user gets without the plugin."""

import dataclasses

from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import PlannerError, ShardingOption, Topology

from torchrec_het import _compat
from torchrec_het.planner.enumerator import stock_only
from torchrec_het.planner.pricing import PLUGIN_TYPES


def torchrec_plan(
    module: nn.Module, sharders: list, topology: Topology, batch_size: int, constraints: dict | None, reservation
) -> tuple[list[ShardingOption] | None, str]:
    """The options of TorchRec's own plan for ``module``, and why there is none: (None, why) where
    TorchRec finds none, or where constraints allow a table plugin types only (the user chose them:
    nothing to compare); (options, "") otherwise."""
    stock_constraints = {}
    for name, c in (constraints or {}).items():
        types = c.sharding_types
        if types and all(t in PLUGIN_TYPES for t in types):
            return None, f"the constraints allow table {name!r} plugin types only ({', '.join(types)})"
        if types:
            c = dataclasses.replace(c, sharding_types=[t for t in types if t not in PLUGIN_TYPES])
        stock_constraints[name] = c
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, constraints=stock_constraints or None,
        storage_reservation=reservation, stats=[], debug=False,
    )  # fmt: skip
    try:
        planner.plan(module, [stock_only(s, topology.compute_device) for s in sharders])
    except (PlannerError, RuntimeError) as error:  # no plan, or no type TorchRec's sharders offer meets the constraints
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        return None, f"it failed ({type(error).__name__}: {first[:300]})"
    return _compat.planner_best_plan(planner), ""
