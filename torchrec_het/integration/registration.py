"""Opt-in registration of the plugin into TorchRec: ``install()`` / ``uninstall()`` (also ``torchrec_het.install()``).

Nothing runs on import. :func:`install` makes TorchRec's ``get_default_sharders()`` return the
plugin's EBC / EC sharders and a stock ``EmbeddingShardingPlanner`` built without its own
enumerator, performance model, partitioner or stats use the plugin's; stock EBC / EC sharders a
script builds itself (e.g. with a ``qcomm_codecs_registry``) become the plugin's, with that
registry and their ``fused_params``, where the planner and ``DistributedModelParallel`` get them
(:func:`swap_stock_sharders`); a ``DistributedModelParallel`` whose plan carries the planner's
prediction checks its step time against it (:mod:`torchrec_het.integration.plan_check`); with a process group
timeout set, ``init_process_group`` calls without ``timeout`` get it. :func:`uninstall` puts
every replaced attribute back. Install before importing a script that binds
``get_default_sharders`` by name (``python -m torchrec_het.launch`` does).
"""

import functools
import inspect
import math
import os
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from torchrec.distributed.model_parallel import DistributedModelParallel

from torchrec_het import _compat
from torchrec_het.config import HetCacheConfig
from torchrec_het.integration.env_settings import (
    ENV_ALPHA,
    ENV_COMPUTE,
    ENV_LINK_GBIT,
    ENV_ONLINE,
    ENV_PROFILE,
    ENV_STALENESS,
    ENV_STEP_COMPUTE,
    PROFILE_HINT,
    SETTINGS,
    env_settings,
    read_compute_costs,
    read_profile,
)
from torchrec_het.planner.access import AccessModel, ProfileTiers, check_not_empty
from torchrec_het.planner.compute_costs import ComputeCosts
from torchrec_het.planner.compute_probe import parse_step_compute
from torchrec_het.planner.network import LinkSettings, parse_link_gbit
from torchrec_het.planner.planner import HetEmbeddingShardingPlanner
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.planner.step_model import Compute
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile


@dataclass
class _Installed:
    cache: HetCacheConfig
    replication: ReplicationConfig
    pricing: PluginPricing
    saved: list[tuple[object, str, object]] = field(default_factory=list)  # (owner, attribute, original)


_state: _Installed | None = None


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _state is not None


def install(
    profile: AccessProfile | str | None = None,
    alpha: float | None = None,
    cache: HetCacheConfig | None = None,
    replica_sync_every: int | None = None,
    max_hot_fraction: float = 0.5,
    online_profile_steps: int | None = None,
    embedding_staleness: int | None = None,
    compute_costs: ComputeCosts | str | None = None,
    pg_timeout: float | timedelta | None = None,
    link_gbit: tuple[float | None, float | None] | str | None = None,
    link_probe: bool | None = None,
    step_compute: tuple[float, float] | str | None = None,
    lookahead: bool | None = None,
    *,
    announce: bool = True,
) -> None:
    """Registers the plugin with TorchRec until :func:`uninstall` (calling it again re-installs).

    The planner offers the plugin's types only for tables whose reads it knows: those the
    profile names, or every table when a skew is stated (``alpha``). Without either it plans
    TorchRec's types only. One line on stderr (rank 0) says which rule applies.

    Args:
        profile: row access counts (an ``AccessProfile`` or an iopath path of one, e.g. from
            ``python -m torchrec_het_bench.profile``); default ``$TORCHREC_HET_PROFILE``. It prices
            the plugin's types for the tables it names and names the rows
            ``het_row_replicated`` replicates. A missing, unreadable or empty profile raises a
            ValueError naming it.
        alpha: a Zipf exponent you state for the ids of tables without counts (default
            ``$TORCHREC_HET_ALPHA``, else none: no skew is assumed); the planner then offers
            ``het_cached_row_wise`` for them, priced from it.
        cache: settings of ``het_cached_row_wise`` tables (default ``HetCacheConfig()``).
        replica_sync_every: replica sync interval of ``het_row_replicated`` tables (default
            ``$TORCHREC_HET_REPLICA_SYNC_EVERY`` or 1, exact).
        max_hot_fraction: at most this share of a table's rows is replicated.
        online_profile_steps: without a profile, let ``het_row_replicated`` tables count their
            reads during this many first steps and then replicate the hot rows (default
            ``$TORCHREC_HET_ONLINE_PROFILE_STEPS`` or 0: off). The counts come after planning,
            so they are no evidence for the planner: it offers row replication then only with
            a stated ``alpha`` or for tables whose constraints name the type.
        embedding_staleness: k >= 0 makes TorchRec's ``TrainPipelineSparseDist`` (as a script
            imports it after this call) the hybrid pipeline with that bound
            (:class:`~torchrec_het.pipeline.HybridTrainPipeline`); default
            ``$TORCHREC_HET_EMBEDDING_STALENESS`` or unset: TorchRec's own.
        compute_costs: the plugin lookups' compute per id the planner prices (a ``ComputeCosts``
            or the path of a table from ``python -m torchrec_het_bench.calibrate``, measured on
            your machines); default ``$TORCHREC_HET_COMPUTE_COSTS``, else the table shipped
            with the package (measured on a 2-core CPU VM).
        pg_timeout: the process group timeout, in seconds (or a ``timedelta``): how long a
            collective waits for its peers before it fails. Given to the script's
            ``torch.distributed.init_process_group`` calls that pass no ``timeout`` of their own
            (the plugin's own groups take their parent group's); default ``$TORCHREC_HET_PG_TIMEOUT``,
            else torch's (30 minutes for gloo).
        link_gbit: ``(intra, inter)`` Gbit/s per rank, every rank sending at once, that the planner
            prices with instead of measuring them (either may be None; a string ``"intra,inter"``
            as the variable takes); default ``$TORCHREC_HET_LINK_GBIT``, else measured.
        link_probe: False: the planner measures nothing (it assumes what is not stated); default
            ``$TORCHREC_HET_LINK_PROBE`` (1/0), else True: ``collective_plan`` probes the links.
        step_compute: ``(lookup, dense)``: a lookup's forward, backward and update in seconds per id
            and the dense part's in seconds per sample, that the planner prices with instead of
            measuring them at plan time (a string ``"LOOKUP_NS,DENSE_US"`` as the variable takes);
            default ``$TORCHREC_HET_STEP_COMPUTE``, else measured.
        lookahead: ``het_row_replicated`` bags look one batch ahead: under ``TrainPipelineSparseDist``
            the next batch's partial sums leave their owners during this step (exact; needs hot rows
            from a profile, not counted online); default ``$TORCHREC_HET_LOOKAHEAD`` (1/0), else off.
        announce: False: print no line on which rule applies (the processes a launched script
            starts itself install quietly: the launcher's worker said it once).
    """
    global _state
    uninstall()
    env = env_settings()
    source = origin = None
    if profile is None and env["profile"] is not None:
        source, origin = env["profile"], ENV_PROFILE
        profile = read_profile(source, f"${ENV_PROFILE}")
    elif isinstance(profile, str):
        source = profile
        profile = read_profile(source, "install(profile=...)")
    if profile is not None:
        check_not_empty(profile, source)
    alpha = env["alpha"] if alpha is None else alpha
    sync = env["replica_sync_every"] if replica_sync_every is None else replica_sync_every
    online = env["online_profile_steps"] if online_profile_steps is None else online_profile_steps
    online = 0 if profile is not None else online
    lookahead = bool(env["lookahead"]) if lookahead is None else lookahead
    if not isinstance(lookahead, bool):
        raise ValueError(f"lookahead must be True or False, got {lookahead!r}")
    if embedding_staleness is None:
        embedding_staleness = env["embedding_staleness"]
    if embedding_staleness is not None and (
        isinstance(embedding_staleness, bool) or not isinstance(embedding_staleness, int) or embedding_staleness < 0
    ):
        raise ValueError(f"embedding_staleness must be an int >= 0, got {embedding_staleness!r}")
    pg_timeout = env["pg_timeout"] if pg_timeout is None else _checked_timeout(pg_timeout)
    cache = cache or HetCacheConfig()
    if compute_costs is None and env["compute_costs"] is not None:
        compute_costs = read_compute_costs(env["compute_costs"], f"${ENV_COMPUTE}")
    elif isinstance(compute_costs, str):
        compute_costs = read_compute_costs(compute_costs, "install(compute_costs=...)")
    pricing = PluginPricing(
        AccessModel(profile, alpha, source, origin),
        max_hot_fraction=max_hot_fraction,
        online_profile_steps=online,
        **({"compute": compute_costs} if compute_costs is not None else {}),
        per_host_tier=False,  # the tiers below know no topology: the planner prices what they build
    )
    links = install_links(link_gbit, link_probe, env)
    compute = install_compute(step_compute, env)
    tiers = ProfileTiers(profile, None, sync, max_hot_fraction) if profile is not None else None
    replication = ReplicationConfig(
        tiers=tiers, replica_sync_every=sync, online_profile_steps=online, online_max_hot_fraction=max_hot_fraction,
        lookahead=lookahead,
    )  # fmt: skip
    state = _Installed(cache, replication, pricing)
    sharder_homes = _compat.default_sharders_homes()  # the first defines it
    plugin_sharders = _plugin_default_sharders(sharder_homes[0].get_default_sharders, state)
    for home in sharder_homes:
        _replace(state, home, "get_default_sharders", plugin_sharders)
    _replace(state, HetEmbeddingShardingPlanner, "installed_pricing", pricing)  # its default pricing
    _replace(
        state, HetEmbeddingShardingPlanner, "installed_links", links
    )  # its link settings; rank 0 prints the figures
    _replace(state, HetEmbeddingShardingPlanner, "installed_compute", compute)
    for home in _compat.planner_homes():
        _replace(state, home, "EmbeddingShardingPlanner", HetEmbeddingShardingPlanner)
    _swap_sharders_given(state, HetEmbeddingShardingPlanner, "plan")  # the sharders a script gives it
    _swap_sharders_given(state, DistributedModelParallel, "__init__")
    _watch_predicted_plans(state, DistributedModelParallel)
    if embedding_staleness is not None:
        hybrid = _hybrid_sparse_dist(embedding_staleness)
        for home in _compat.train_pipeline_homes():
            _replace(state, home, "TrainPipelineSparseDist", hybrid)
    if pg_timeout is not None:
        _default_pg_timeout(state, pg_timeout)
    _state = state
    if announce and os.environ.get("RANK", "0") == "0":
        print(f"torchrec_het: {pricing_rule(pricing)}", file=sys.stderr, flush=True)


def install_compute(step_compute, env: dict) -> Compute | None:
    """The compute the planner prices with from ``install()``'s argument, else the environment's (None: measured)."""
    origin = "install(step_compute=...)"
    if step_compute is None and env["step_compute"] is not None:
        step_compute, origin = env["step_compute"], f"${ENV_STEP_COMPUTE}"
    elif isinstance(step_compute, str):
        step_compute = parse_step_compute(step_compute, origin)
    elif step_compute is not None and (
        not isinstance(step_compute, tuple | list)
        or len(step_compute) != 2
        or not all(isinstance(v, int | float) and 0 < v < math.inf for v in step_compute)
    ):
        raise ValueError(
            f"{origin}: expected (lookup seconds per id, dense seconds per sample), both > 0, got {step_compute!r}"
        )
    if step_compute is None:
        return None
    lookup, dense = step_compute
    return Compute(float(lookup), float(dense), source=f"stated ({origin})")


def install_links(link_gbit, link_probe: bool | None, env: dict) -> LinkSettings:
    """The planner's link settings from ``install()``'s arguments, else the environment's."""
    origin = "install(link_gbit=...)"
    if link_gbit is None and env["link_gbit"] is not None:
        link_gbit, origin = env["link_gbit"], f"${ENV_LINK_GBIT}"
    elif isinstance(link_gbit, str):
        link_gbit = parse_link_gbit(link_gbit, origin)
    elif link_gbit is not None and (not isinstance(link_gbit, tuple | list) or len(link_gbit) != 2):
        raise ValueError(
            f"{origin}: expected (intra, inter) in Gbit/s per rank (either may be None), got {link_gbit!r}"
        )
    intra, inter = link_gbit if link_gbit is not None else (None, None)
    probe = env["link_probe"] if link_probe is None else link_probe
    return LinkSettings(intra, inter, True if probe is None else probe, origin)


def pricing_rule(pricing: PluginPricing) -> str:
    """One line saying which tables the planner may give the plugin's types, and why."""
    access, online = pricing.access, pricing.online_profile_steps
    if access.profile is not None:
        where = f"access profile {access.source}" if access.source else "access profile"
        return (
            f"{where} ({len(access.profile.tables)} tables, {access.profile.batches} batches): the planner may choose "
            "the plugin's types for the tables it names, TorchRec's types for the others"
        )
    if access.alpha is not None:
        types = "het_cached_row_wise" + (
            f" and het_row_replicated (hot rows counted in the first {online} steps)" if online else ""
        )
        return (
            f"no access profile; stated skew Zipf({access.alpha:g}) (${ENV_ALPHA} or install(alpha=...)): the planner "
            f"may choose {types} for every table, priced from that skew"
        )
    online_note = (
        f" (${ENV_ONLINE}={online} counts reads only after planning: it applies to tables whose constraints "
        "name het_row_replicated)"
        if online
        else ""
    )
    return (
        f"no access profile: the planner offers only TorchRec's sharding types{online_note}; profile your batches "
        f"({PROFILE_HINT}) and set ${ENV_PROFILE} (or install(profile=...)) to let it choose the plugin's"
    )


def settings_help() -> str:
    """The ``TORCHREC_HET_*`` settings, one per line, for ``--help``."""
    width, arguments = max(len(s.variable) for s in SETTINGS), inspect.signature(install).parameters
    return "\n".join(
        textwrap.fill(
            s.help + (f" (install({s.argument}=...))" if s.argument in arguments else ""),
            100,
            initial_indent=f"  {s.variable:<{width}}  ",
            subsequent_indent=" " * (width + 4),
        )
        for s in SETTINGS
    )


def _checked_timeout(value: float | timedelta) -> timedelta:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < float("inf"):
        raise ValueError(f"pg_timeout must be a number of seconds > 0 or a positive timedelta, got {value!r}")
    return timedelta(seconds=seconds)


def _default_pg_timeout(state: _Installed, timeout: timedelta) -> None:
    """``init_process_group`` (both homes) passes ``timeout`` where its caller gives none."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    stock = distributed_c10d.init_process_group

    @functools.wraps(stock)
    def init_process_group(*args, **kwargs):
        if len(args) >= 3:  # timeout is the third parameter
            args = (*args[:2], timeout if args[2] is None else args[2], *args[3:])
        elif kwargs.get("timeout") is None:
            kwargs["timeout"] = timeout
        return stock(*args, **kwargs)

    for home in (dist, distributed_c10d):
        _replace(state, home, "init_process_group", init_process_group)


def installed_pricing() -> PluginPricing | None:
    """The planner settings of the current installation, or None."""
    return _state.pricing if _state is not None else None


def uninstall() -> None:
    """Restores everything :func:`install` replaced; a no-op when not installed."""
    global _state
    if _state is None:
        return
    for owner, attribute, original in reversed(_state.saved):
        setattr(owner, attribute, original)
    _state = None


def _replace(state: _Installed, owner: object, attribute: str, replacement: object) -> None:
    state.saved.append((owner, attribute, getattr(owner, attribute)))
    setattr(owner, attribute, replacement)


def _plugin_default_sharders(stock: Callable[[], list], state: _Installed) -> Callable[[], list]:
    from torchrec_het.sharders import get_het_sharders

    def get_default_sharders() -> list:
        """TorchRec's default sharders, with the EmbeddingBagCollection and EmbeddingCollection
        sharders replaced by torchrec_het's (installed by ``torchrec_het.install()``)."""
        return get_het_sharders(state.cache, state.replication, stock=stock)

    return get_default_sharders


def swap_stock_sharders(sharders: list | None) -> list | None:
    """``sharders`` with each stock ``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder``
    replaced by the plugin's, built with the installed settings and that sharder's
    ``qcomm_codecs_registry`` and ``fused_params``; other sharders (the plugin's too) as given.
    Unchanged when not installed, or for None."""
    if _state is None or sharders is None:
        return sharders
    return _swapped(list(sharders), _state)


def _swapped(sharders: list, state: _Installed) -> list:
    from torchrec_het.sharders import get_het_sharders

    return get_het_sharders(state.cache, state.replication, stock=lambda: sharders)


def _swap_sharders_given(state: _Installed, owner: type, method: str) -> None:
    """``owner.method`` (whose parameter ``sharders`` takes a list) gets :func:`swap_stock_sharders`'s list."""
    stock = getattr(owner, method)
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def with_plugin_sharders(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("sharders") is not None:
            bound.arguments["sharders"] = _swapped(list(bound.arguments["sharders"]), state)
        return stock(*bound.args, **bound.kwargs)

    _replace(state, owner, method, with_plugin_sharders)


def _watch_predicted_plans(state: _Installed, owner: type) -> None:
    """``owner.__init__`` (``DistributedModelParallel``'s) then watches the model's steps against the
    prediction its plan carries (given or planned; :func:`torchrec_het.integration.plan_check.watch_plan`), kept
    as ``self._het_step_watch``."""
    from torchrec_het.integration.plan_check import prediction_of, watch_plan

    stock = owner.__init__
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def watching_init(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        plan = getattr(self, "plan", None)  # DistributedModelParallel.plan: given or planned
        if plan is None:
            plan = signature.bind(self, *args, **kwargs).arguments.get("plan")
        if prediction_of(plan) is not None:
            watch_plan(self, plan)

    _replace(state, owner, "__init__", watching_init)


def _hybrid_sparse_dist(k: int) -> type:
    """``TrainPipelineSparseDist``'s constructor, building the hybrid pipeline with bound ``k``."""
    import sys

    import torch.distributed as dist

    from torchrec_het.pipeline import HybridTrainPipeline

    class TrainPipelineSparseDist(HybridTrainPipeline):
        """TorchRec's ``TrainPipelineSparseDist`` as torchrec_het installed it: the hybrid pipeline."""

        def __init__(
            self, model, optimizer, device, execute_all_batches: bool = True, apply_jit: bool = False, **kwargs
        ):
            super().__init__(
                model,
                optimizer,
                device,
                embedding_staleness=k,
                execute_all_batches=execute_all_batches,
                apply_jit=apply_jit,
                **kwargs,
            )
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(
                    f"torchrec_het: TrainPipelineSparseDist runs as the hybrid pipeline, embedding_staleness={k} "
                    f"(${ENV_STALENESS})",
                    file=sys.stderr,
                    flush=True,
                )

    return TrainPipelineSparseDist
