"""An enumerator that offers the plugin's sharding types beside TorchRec's own.

TorchRec enumerates with ``row_wise`` standing in for the plugin's types (they shard rows as
it does); each stand-in option becomes one option per plugin type the sharder offers and the
table allows, priced with the plugin's estimators. Plugin types are offered only for tables
with evidence of their reads or whose constraints name the type.

Design: docs/internals.md#planner-enumerator
"""

import copy
import dataclasses

from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE, POOLING_FACTOR
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Topology
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ModuleSharder, ShardingType

from torchrec_het import _compat
from torchrec_het.planner.compute_probe import table_configs
from torchrec_het.planner.cost_model import DEFAULT_MARGIN
from torchrec_het.planner.estimators import HetPerfEstimator, HetStorageEstimator
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing, attach_options, attach_wire, priced_options
from torchrec_het.planner.qcomms import wire_precision
from torchrec_het.types import HET_ROW_REPLICATED

ROW_WISE = ShardingType.ROW_WISE.value


class HetEmbeddingEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` that also enumerates ``het_cached_row_wise`` and ``het_row_replicated``.

    Args:
        topology, batch_size, constraints, use_exact_enumerate_order: as TorchRec's.
        estimator: estimators; default the plugin's perf and storage estimators (which
            delegate TorchRec's types to TorchRec's estimators).
        pricing: reads per row (a profile, or a stated skew) and the lookups' compute.

    Each plugin option carries the plan options its sharder gives the table
    (``sharder.table_options``, :func:`~torchrec_het.planner.pricing.priced_options`): the
    estimators price them and the planner puts them in the plan. It also carries the wire bytes of
    the codecs its sharder's ``qcomm_codecs_registry`` gives its embeddings
    (:func:`~torchrec_het.planner.pricing.priced_wire`); TorchRec's estimator prices the stock
    options under the same registry.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = BATCH_SIZE,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator=None,
        use_exact_enumerate_order: bool | None = False,
        pricing: PluginPricing | None = None,
    ) -> None:
        self.pricing = pricing or PluginPricing()
        self.world_size = topology.world_size
        self.plan_options: dict[tuple[str, str, str], object] = {}  # (module path, table, type) -> options
        if estimator is None:
            estimator = [
                HetPerfEstimator(topology, constraints, self.pricing),
                HetStorageEstimator(topology, constraints, self.pricing),
            ]
        estimators = estimator if isinstance(estimator, list) else [estimator]
        # the one cost model prices through it: the planner gives it its measured links and compute
        self.perf_estimator = next((e for e in estimators if isinstance(e, HetPerfEstimator)), None)
        super().__init__(topology, batch_size, constraints, estimator, use_exact_enumerate_order)

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        device, _, constraints = _compat.enumerator_settings(self)
        offered = {sharder_name(s.module_type): _plugin_types(s, device) for s in sharders}
        if self.perf_estimator is not None:  # every option is priced under its sharder's codecs
            self.perf_estimator.registries = {
                sharder_name(s.module_type): getattr(s, "qcomm_codecs_registry", None) for s in sharders
            }
        if not any(offered.values()):
            return super().enumerate(module, sharders)
        self.pricing.access.check_matches(table_rows(module))
        by_key = {sharder_name(s.module_type): s for s in sharders}
        stand_in_constraints = _with_row_wise_for_plugin(self._with_measured_pooling(module, constraints))
        with _compat.enumerator_constraints(self, stand_in_constraints):
            options = super().enumerate(module, [_row_wise_stand_in(s, device) for s in sharders])
        _compat.set_enumerator_sharders(self, by_key)
        out, added = [], []
        for option in options:
            key = option.module_type_key
            if option.sharding_type != ROW_WISE:
                out.append(option)
                continue
            sharder = by_key[key]
            if self._allows(option.name, ROW_WISE, sharder):  # not just the stand-in of a plugin type
                out.append(option)
            elif self.perf_estimator is not None:  # the table may not take it: no runner-up in the stats
                self.perf_estimator.forget(option.name, ROW_WISE)
            for sharding_type in offered.get(key, ()):
                if not (self._allows(option.name, sharding_type, sharder) and self._offers(option.name, sharding_type)):
                    continue
                if option.compute_kernel not in sharder.compute_kernels(sharding_type, device):
                    continue
                twin = copy.deepcopy(option)
                twin.sharding_type = sharding_type
                registry = getattr(sharder, "qcomm_codecs_registry", None)
                attach_wire(twin, wire_precision(registry, sharding_type, option.is_pooled))
                table_options = getattr(sharder, "table_options", None)  # the plugin's sharders: their settings
                if table_options is not None:
                    settings = table_options(option.module[1], option.name, sharding_type, self.world_size)
                    attach_options(twin, settings)
                    self.plan_options[(option.path, option.name, sharding_type)] = settings
                added.append(twin)
        if added:
            for shard in (s for o in added for s in o.shards):
                shard.perf = shard.storage = None
            self.populate_estimates(added)
            added = self._cheaper_cold_tiers(added, by_key)
        kept = {o.name for o in out + added}
        for option in options:
            if option.name not in kept:
                raise ValueError(self._nothing_left(option.name, by_key[option.module_type_key], sharders))
        return out + added

    def _cheaper_cold_tiers(self, options: list[ShardingOption], by_key: dict) -> list[ShardingOption]:
        """``options``, each ``het_row_replicated`` bag table whose sharder leaves its cold ids to the
        planner priced with fetched rows too (one estimate of them all), and taking them where the step
        model prices them cheaper than partial sums (bytes and compute) by more than its error
        (:data:`~torchrec_het.planner.cost_model.DEFAULT_MARGIN`)."""
        twins = {}
        for at, option in enumerate(options):
            chooses = getattr(by_key[option.module_type_key], "planner_chooses_cold_rows", None)
            if (
                option.sharding_type == HET_ROW_REPLICATED
                and option.is_pooled
                and chooses
                and chooses(option.module[1])
            ):
                rows = copy.deepcopy(option)
                attach_options(rows, dataclasses.replace(priced_options(option), cold_rows=True))
                for shard in rows.shards:
                    shard.perf = shard.storage = None
                twins[at] = rows
        if not twins:
            return options
        self.populate_estimates(list(twins.values()))
        out = list(options)
        for at, rows in twins.items():
            if rows.total_perf * (1.0 + DEFAULT_MARGIN) < options[at].total_perf:
                self.plan_options[(rows.path, rows.name, HET_ROW_REPLICATED)] = priced_options(rows)
                out[at] = rows
        return out

    def _nothing_left(self, name: str, sharder: ModuleSharder, sharders: list[ModuleSharder]) -> str:
        """Why no type the constraints of table ``name`` allow can be built, type by type."""
        device, _, constraints = _compat.enumerator_settings(self)
        allowed = list(constraints[name].sharding_types)
        module = sharder.module_type.__name__
        reasons, wrong_module = [], False
        for sharding_type in allowed:
            if sharding_type not in sharder.sharding_types(device):
                kinds = sorted({s.module_type.__name__ for s in sharders if sharding_type in s.sharding_types(device)})
                only = (
                    f"supports {' and '.join(kinds)} tables only" if kinds else f"is offered by no sharder on {device}"
                )
                article = "an" if module[0] in "AEIOU" else "a"
                reasons.append(f"{sharding_type} {only}, and the table's module is {article} {module}")
                wrong_module = True
            elif sharding_type in PLUGIN_TYPES and not self._offers(name, sharding_type):
                reasons.append(f"{sharding_type} needs {self.pricing.needs(sharding_type)}")
        reasons = reasons or [f"TorchRec enumerated no option of {allowed} for it"]
        advice = ""
        if wrong_module:
            supported = sharder.sharding_types(device)
            plugin = [t for t in supported if t in PLUGIN_TYPES]
            advice = (
                f"; constrain it to a type {module} supports instead (e.g. ParameterConstraints(sharding_types="
                f"{[t for t in supported if t not in PLUGIN_TYPES][:3]})"
                + (f", or the plugin's {' or '.join(plugin)}" if plugin else "")
                + ")"
            )
        return (
            f"table {name!r}: no sharding type is left for it; its constraints allow {allowed}: "
            + "; ".join(reasons)
            + advice
        )

    def _with_measured_pooling(self, module: nn.Module, constraints):
        """``constraints`` plus the profile's ids per sample for measured tables left at TorchRec's default."""
        out = dict(constraints or {})
        profile, batch_size = self.pricing.access.profile, _compat.enumerator_settings(self)[1]
        for name in table_rows(module):
            if not self.pricing.access.measured(name) or not profile.batches:
                continue
            given = out.get(name)
            if given is not None and (
                list(given.pooling_factors) != [POOLING_FACTOR] or given.num_poolings or given.batch_sizes
            ):
                continue
            per_sample = float(profile.table_counts(name).sum()) / profile.batches / batch_size
            base = given if given is not None else ParameterConstraints()
            out[name] = dataclasses.replace(base, pooling_factors=[max(per_sample, 1e-6)])
        return out or constraints

    def _offers(self, name: str, sharding_type: str) -> bool:
        """The evidence rule: a plugin type for a table whose reads are known or whose constraints
        name the type, if the pricing can build it there (row replication needs hot rows)."""
        _, _, constraints = _compat.enumerator_settings(self)
        named = bool(constraints) and name in constraints and sharding_type in (constraints[name].sharding_types or ())
        return (named or self.pricing.access.has_evidence(name)) and self.pricing.offers(sharding_type, name)

    def _allows(self, name: str, sharding_type: str, sharder: ModuleSharder) -> bool:
        """Whether the sharder offers ``sharding_type`` and the table's constraints (if any) allow it."""
        device, _, constraints = _compat.enumerator_settings(self)
        if sharding_type not in sharder.sharding_types(device):
            return False
        allowed = constraints[name].sharding_types if constraints and name in constraints else None
        return not allowed or sharding_type in allowed


def table_rows(module: nn.Module) -> dict[str, int]:
    """Every EmbeddingBagCollection / EmbeddingCollection table of ``module``: name -> rows."""
    return {name: config.num_embeddings for name, config in table_configs(module).items()}


def _plugin_types(sharder: ModuleSharder, device: str) -> list[str]:
    return [t for t in sharder.sharding_types(device) if t in PLUGIN_TYPES]


def _row_wise_stand_in(sharder: ModuleSharder, device: str) -> ModuleSharder:
    """A shallow copy of ``sharder`` that offers ``row_wise`` in place of the plugin's types."""
    types = [t for t in sharder.sharding_types(device) if t not in PLUGIN_TYPES]
    if len(types) == len(sharder.sharding_types(device)):
        return sharder
    if ROW_WISE not in types:
        types.append(ROW_WISE)
    stand_in = copy.copy(sharder)
    stand_in.sharding_types = lambda compute_device_type: list(types)  # instance attribute shadows the method
    return stand_in


def _with_row_wise_for_plugin(constraints: dict[str, ParameterConstraints] | None):
    """Constraints in which a table allowed a plugin type is allowed ``row_wise`` (its stand-in)."""
    if not constraints:
        return constraints
    out = {}
    for name, c in constraints.items():
        types = c.sharding_types
        if types and any(t in PLUGIN_TYPES for t in types):
            kept = [t for t in types if t not in PLUGIN_TYPES]
            c = dataclasses.replace(c, sharding_types=kept + ([ROW_WISE] if ROW_WISE not in kept else []))
        out[name] = c
    return out


def stock_only(sharder: ModuleSharder, device: str) -> ModuleSharder:
    """A shallow copy of ``sharder`` that offers only the types TorchRec's own sharder it derives from
    offers (what a user gets without the plugin: e.g. no ``row_wise`` for bags on CPU, which the
    plugin's sharder adds), less any its own sharder leaves out."""
    types = [t for t in sharder.sharding_types(device) if t not in PLUGIN_TYPES]
    base = next((c for c in type(sharder).__mro__ if c.__module__.startswith("torchrec.")), None)
    if base is not None and base is not type(sharder) and hasattr(base, "sharding_types"):
        stock = base.sharding_types(sharder, device)
        types = [t for t in types if t in stock]
    if types == list(sharder.sharding_types(device)):
        return sharder
    stock = copy.copy(sharder)
    stock.sharding_types = lambda compute_device_type: list(types)  # instance attribute shadows the method
    return stock
