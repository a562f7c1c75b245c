"""The step model's prediction for every benchmark entry, recorded beside what the entry measured.

Once per run (:func:`model_inputs`, a collective), every rank profiles its 5% sample of the
training stream (the profile the ``planned`` configurations plan with), and times two probes
on this machine: a TBE lookup of the preset's width (forward, backward and fused update, per
id) and the DLRM's dense part (bottom MLP, interaction, top MLP, loss, backward and Adagrad
step, per sample). The links are those the run measured (``network.links``). Per entry,
rank 0 reads the plan the entry trained with (each table's type, placement and settings) and the
quantized-comms codecs of the sharders it was sharded with (their ``qcomm_codecs_registry``), and
asks :func:`torchrec_het.planner.step_model.predict_step` for its bytes and step.

Nothing here reads what an entry measured: the prediction is made before training, from the
plan, the profile and the probes.
"""

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_het.plan_options import options_of
from torchrec_het.planner.compute_costs import default_compute_costs
from torchrec_het.planner.plan_tables import planned_table
from torchrec_het.planner.step_model import Cluster, Compute, Links, PlannedTable, predict_step, with_codecs
from torchrec_het.replication.config import ReplicaOptions
from torchrec_het.replication.profile import AccessProfile, count_accesses
from torchrec_het.types import HET_ROW_REPLICATED
from torchrec_het_bench.tbe_cost import lookup_seconds_per_id

GBIT = 1e9 / 8
PREDICTION_BATCHES = 40  # per rank, spread over the run's steps  # bytes/s per Gbit/s
PIPELINE_MODEL = {"plain": "plain", "sparse_dist": "sparse_dist", "prefetch_sparse_dist": "sparse_dist",
                  "hybrid": "hybrid", "semi_sync": "hybrid", "pec": "sparse_dist"}  # fmt: skip


@dataclass(frozen=True)
class ModelInputs:
    """What the model predicts every entry of a run from (the same on rank 0 for every entry)."""

    profile: AccessProfile  # reads per step of one rank's batch, summed over the ranks' samples
    links: Links
    compute: Compute
    dense_params: int


def model_inputs(spec, source, tables: list) -> ModelInputs:
    """The run's profile, links and compute probes (a collective: every rank calls it)."""
    from torchrec_het_bench.workloads import PROFILE_EVERY

    # batches the configurations' own profile (every 20th from step 0) does not hold: rows chosen
    # hot because a sample read them often are read less often elsewhere, and the model must see that
    rank, others = dist.get_rank(), [s for s in range(spec.preset.total_steps) if s % PROFILE_EVERY]
    steps = others[:: max(1, len(others) // PREDICTION_BATCHES)]
    local = count_accesses([source.batch(step, rank, "train").sparse_features for step in steps], tables)
    counts = []
    for table_counts in local.counts:
        total = table_counts.clone()
        dist.all_reduce(total)
        counts.append(total)
    profile = AccessProfile(local.tables, local.num_rows, tuple(counts), local.batches * spec.world_size)
    dense_step, dense, dense_params = dense_costs(spec.preset, source.num_dense, len(tables))
    costs = default_compute_costs()
    compute = Compute(
        lookup_s_per_id=lookup_seconds_per_id(
            spec.preset.table_sizes, spec.preset.embedding_dim, spec.preset.batch_size * spec.world_size
        ),
        module_s_per_step=module_seconds_per_step(spec.preset, len(tables)),
        dense_s_per_sample=dense,
        dense_s_per_step=dense_step,
        extra_s_per_id=costs.extras_on("cpu"),
        source="probes on this machine (a stock module's step, the dense part); plugin extras from "
        + Path(str(costs.source)).name,
    )
    return ModelInputs(profile, run_links(spec.network), compute, dense_params)


def run_links(network: dict) -> Links:
    """The run's measured links (``network.links``: the planner's probe), else the emulated rate."""
    figures = network.get("links") or {}
    probe = figures.get("probe") or {}
    latencies = [p["latency_ms"] for p in (probe.get("intra"), probe.get("inter")) if p and p.get("latency_ms")]
    if figures:
        return Links(
            figures["intra_gbit"] * GBIT,
            figures["inter_gbit"] * GBIT,
            max(latencies, default=0.0) / 1e3,
            f"intra {figures['intra_source']}, inter {figures['inter_source']} (network.links)",
        )
    rate = (network.get("gbit") or 10.0) * GBIT
    return Links(rate, rate, 0.0, "stated: the emulated rate")


def module_seconds_per_step(preset, num_features: int, steps: int = 6) -> float:
    """A stock sharded embedding module's own work per step on this machine and group, beyond its
    kernels' per-id cost: a table_wise ``EmbeddingBagCollection`` of the preset's features (narrow
    tables of few rows, so little moves) sharded on the run's group, its forward and backward with
    the fused update timed at the preset's batch and a quarter of it; the step's intercept at no
    ids is the module's fixed work (TorchRec's dist stages, permutes, awaitables, collectives'
    latency). A collective: every rank calls it."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_het_bench.topology import cpu_topology

    rows, keys = 1000, [f"probe{i}" for i in range(num_features)]
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=4, num_embeddings=rows, feature_names=[k]) for k in keys]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.01})
    sharder = EmbeddingBagCollectionSharder()
    topology = cpu_topology(dist.get_world_size(), dist.get_world_size())
    constraints = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables}
    reservation = FixedPercentageStorageReservation(percentage=0.05)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, storage_reservation=reservation)
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(dist.get_rank())

    def step_seconds(batch: int) -> float:
        values = torch.randint(0, rows, (batch * num_features,), generator=generator)
        lengths = torch.ones(batch * num_features, dtype=torch.int32)
        features = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        times = []
        for _ in range(2 + steps):
            dist.barrier()
            start = time.perf_counter()
            model(features).values().sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    full, quarter = preset.batch_size, max(preset.batch_size // 4, 1)
    t_full, t_quarter = step_seconds(full), step_seconds(quarter)
    slope = (t_full - t_quarter) / (full - quarter)
    return max(t_quarter - slope * quarter, 0.0)


def dense_costs(preset, num_dense: int, num_sparse: int, steps: int = 8) -> tuple[float, float, int]:
    """(wall seconds per step, per sample, parameters) of the DLRM's dense part: bottom MLP,
    interaction, top MLP, loss, backward and Adagrad step, on random pooled embeddings, timed at
    the preset's batch and a quarter of it (the per-step part: the intercept)."""
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    dim, batch = preset.embedding_dim, preset.batch_size
    dense_arch = DenseArch(num_dense, list(preset.dense_arch))
    interaction = InteractionArch(num_sparse)
    over_in = dim + num_sparse * (num_sparse + 1) // 2
    over_arch = OverArch(over_in, list(preset.over_arch))
    parts = nn.ModuleList([dense_arch, interaction, over_arch])
    optimizer = torch.optim.Adagrad(parts.parameters(), lr=preset.learning_rate)
    generator = torch.Generator().manual_seed(0)

    def step_seconds(size: int) -> float:
        dense = torch.randn(size, num_dense, generator=generator)
        pooled = torch.randn(size, num_sparse, dim, generator=generator)
        labels = torch.randint(0, 2, (size,), generator=generator).float()
        times = []
        for _ in range(3 + steps):
            start = time.perf_counter()
            logits = over_arch(interaction(dense_arch(dense), pooled)).squeeze(-1)
            nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])

    quarter = max(batch // 4, 1)
    t_full, t_quarter = step_seconds(batch), step_seconds(quarter)
    per_sample = max(t_full - t_quarter, 0.0) / max(batch - quarter, 1)
    return max(t_full - per_sample * batch, 0.0), per_sample, sum(p.numel() for p in parts.parameters())


def module_plan(sharded) -> dict:
    """Each table's ``ParameterSharding`` as the sharded modules hold it (a hand-written plan's plugin
    entries get their sharder's options there), else as the plan gives it."""
    held = {}
    for module in sharded.model.modules():
        held.update(getattr(module, "het_plan", None) or {})
    return held or dict(next(iter(sharded.plan.plan.values())))


def built_tiers(sharded) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each row-replicated table's (replicated, per-host) row ids, as its module built them."""
    tiers = {}
    for module in sharded.model.modules():
        for lookup in module.replicated_lookups() if hasattr(module, "replicated_lookups") else ():
            for g in lookup.groups:
                for i, table in enumerate(g.tables):
                    low, high = int(g.offsets[i]), int(g.offsets[i + 1])
                    tiers[table.name] = tuple(ids[(ids >= low) & (ids < high)] - low for ids in (g.hot, g.host))
    return tiers


def planned_tables(
    module_plan: dict, tables: list, profile: AccessProfile, world_size: int, batch: int, built: dict | None = None
) -> list[PlannedTable]:
    """Each table of an embedding module's plan as the model sees it (:func:`~torchrec_het.planner.plan_tables.planned_table`):
    type, placement, settings, reads; ``built``: the row-replicated tables' tiers (:func:`built_tiers`)."""
    built = built or {}
    planned = []
    for config in tables:
        sharding = module_plan[config.name]
        reads = profile.table_counts(config.name).double() * world_size / max(profile.batches, 1)
        kind, options = sharding.sharding_type, options_of(sharding)
        hot = host = None
        if kind == HET_ROW_REPLICATED:
            options = options or ReplicaOptions()
            hot, host = (reads[ids] for ids in built.get(config.name, (torch.zeros(0, dtype=torch.int64),) * 2))
        owners, widths = (), ()
        if kind in ("table_wise", "column_wise", "table_column_wise"):
            owners = tuple(sharding.ranks or ())
            if sharding.sharding_spec is not None and kind != "table_wise":
                widths = tuple(int(s.shard_sizes[1]) for s in sharding.sharding_spec.shards)
        planned.append(
            planned_table(
                config.name,
                config.num_embeddings,
                config.embedding_dim,
                len(config.feature_names),
                float(reads.sum()) / world_size / batch,
                kind,
                options,
                reads=reads,
                hot=hot,
                per_host=host,
                owners=owners,
                shard_dims=widths,
                pooled=isinstance(config, EmbeddingBagConfig),
            )  # fmt: skip
        )
    return planned


def predict_entry(sharded, tables: list, inputs: ModelInputs, spec, pipeline: str, batch: int) -> dict:
    """The ``predicted`` block of an entry of results.json."""
    ws, local = spec.world_size, spec.local_world_size
    cluster = Cluster(ws, local, batch)
    planned = planned_tables(module_plan(sharded), tables, inputs.profile, ws, batch, built_tiers(sharded))
    planned = [with_codecs(table, sharded.model.sharders) for table in planned]  # the sharders' codecs
    model_pipeline = PIPELINE_MODEL.get(pipeline, "sparse_dist")
    try:
        step = predict_step(planned, cluster, inputs.links, inputs.compute, model_pipeline, inputs.dense_params)
    except ValueError as unmodelled:  # a type the model has no bytes for (e.g. table_row_wise): said, not guessed
        return {"not_modelled": str(unmodelled)}
    return {
        **planner_prediction(sharded),
        "bytes_per_step": step.bytes.as_dict(),
        "dense_allreduce": round(2 * (ws - 1) * inputs.dense_params * 4) if ws > 1 else 0,
        "step_ms": {k: round(v, 3) for k, v in step.step_ms().items()},
        "pipeline_model": model_pipeline,
        "links": {
            "intra_gbit": inputs.links.intra / GBIT,
            "inter_gbit": inputs.links.inter / GBIT,
            "latency_ms": inputs.links.latency * 1e3,
            "source": inputs.links.source,
        },  # fmt: skip
        "compute": {
            "lookup_ns_per_id": inputs.compute.lookup_s_per_id * 1e9,
            "module_ms_per_step": inputs.compute.module_s_per_step * 1e3,
            "dense_us_per_sample": inputs.compute.dense_s_per_sample * 1e6,
            "dense_ms_per_step": inputs.compute.dense_s_per_step * 1e3,
            "source": inputs.compute.source,
        },  # fmt: skip
    }


def planner_prediction(sharded) -> dict:
    """The plugin planner's own plan-time prediction and choice, where the entry's plan carries one
    (``{"planner": {...}}``; else empty)."""
    from torchrec_het.integration.plan_check import prediction_of

    carried = prediction_of(getattr(sharded, "plan", None))
    if carried is None:
        return {}
    return {
        "planner": {
            "chosen": carried.chosen,
            "step_ms": round(carried.step_ms, 3),
            "stock_step_ms": None if carried.stock_step_ms is None else round(carried.stock_step_ms, 3),
            "source": carried.source,
        }
    }


def prediction_error(entry: dict) -> dict | None:
    """Predicted over measured, minus 1, of the entry's embedding bytes, inter-host bytes and step time."""
    predicted = entry.get("predicted")
    if not predicted or "bytes_per_step" not in predicted or "bytes_per_step" not in entry:
        return None
    measured_bytes = entry["bytes_per_step"]
    errors = {}
    for key in ("fwd_ids", "fwd_emb", "bwd_grad", "embedding_cross_rank"):
        if measured_bytes.get(key):
            errors[key] = predicted["bytes_per_step"][key] / measured_bytes[key] - 1
    if entry.get("inter_host_embedding_bytes"):
        errors["inter_host_embedding"] = (
            predicted["bytes_per_step"]["inter_host_embedding"] / entry["inter_host_embedding_bytes"] - 1
        )
    errors["step_total"] = predicted["step_ms"]["total"] / entry["step_ms"]["total"] - 1
    return {k: round(v, 4) for k, v in errors.items()}


def prediction_table(results: dict) -> list[str]:
    """Markdown lines: each entry's predicted bytes and step beside the measured ones, and the
    errors (none when no entry carries a prediction)."""
    entries = [c for c in results["configs"] if c.get("prediction_error") and "bytes_per_step" in c]
    if not entries:
        return []
    first = entries[0]["predicted"]
    c, links = first["compute"], first["links"]
    lines = [
        f"The step model ({first['pipeline_model']} and the other pipelines' overlap: "
        "`torchrec_het/planner/step_model.py`) predicted each entry from its plan before training: links "
        f"{links['intra_gbit']:.2f} / {links['inter_gbit']:.2f} Gbit/s within / between hosts, "
        f"{links['latency_ms']:.2f} ms per collective ({links['source']}); compute {c.get('module_ms_per_step', 0):.2f} ms "
        f"per module step + {c['lookup_ns_per_id']:.0f} ns per id, dense {c.get('dense_ms_per_step', 0):.2f} ms "
        f"+ {c['dense_us_per_sample']:.1f} us per sample ({c['source']}).",
        "",
        "| entry | MiB/step measured | predicted | error | inter-host error | step ms measured "
        "(emb fwd / emb bwd / dense / comm wait / total) | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    parts = ("emb_fwd", "emb_bwd", "dense", "comm_wait", "total")
    for e in entries:
        p, err = e["predicted"], e["prediction_error"]
        inter = err.get("inter_host_embedding")
        measured_ms = " / ".join(f"{e['step_ms'][k]:.1f}" for k in parts)
        predicted_ms = " / ".join(f"{p['step_ms'][k]:.1f}" for k in parts)
        lines.append(
            f"| {e['name']} | {e['bytes_per_step']['embedding_cross_rank'] / 2**20:.3f} "
            f"| {p['bytes_per_step']['embedding_cross_rank'] / 2**20:.3f} | {err['embedding_cross_rank']:+.1%} "
            f"| {'-' if inter is None else f'{inter:+.1%}'} "
            f"| {measured_ms} | {predicted_ms} | {err['step_total']:+.1%} |"
        )
    return lines
