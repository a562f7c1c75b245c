"""Rank bodies of tests/distributed/test_het_evaluation.py: evaluation forwards between the training
steps of ``het_cached_row_wise`` tables leave training bitwise unchanged.

The same training runs twice (fused SGD, skewed batches, caches under eviction pressure, both
protocols; once fetching in the lookup, once fetching ahead), once with evaluation forwards (the
model in ``eval()`` mode under ``no_grad``, on batches of their own, whose remote rows the caches
lack) after some steps and once without. Loops: plain forward/backward, and
``TrainPipelineSparseDist`` (the evaluation runs the sharded module's three stages itself while the
pipeline holds the next batch's input dist; the model's forward is the pipeline's). Each
evaluation is checked to leave every cache slot, pin and clock as it found them, and after the
last step the two runs' caches, owners' versions and shards are compared bit for bit.
"""

import torch

from torchrec_het.config import CacheSettings
from torchrec_het_testing import het_behaviour_ranks as behaviour
from torchrec_het_testing.het_pipeline_ranks import AHEAD_CASES, het_model, pooled_loss, sparse_dist_pipeline
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

STEPS = 8
EVALUATE_AFTER = (0, 2, 3, 5)  # steps after which the evaluating run evaluates (two batches each time)
# read in the lookup: het s_read < ws * (s_write + 1) in one of the groups
IN_LOOKUP_CASES = [
    CacheSettings(s_read=1, s_write=0, capacity=behaviour.PRESSURE_ROWS),
    CacheSettings(s_read=3, s_write=2, capacity=behaviour.PRESSURE_ROWS, policy="lfu"),
    CacheSettings(s_read=1, s_write=0, capacity=behaviour.PRESSURE_ROWS, protocol="lease"),
    CacheSettings(s_read=3, s_write=2, capacity=1.0, protocol="lease", policy="lfu"),
]


def cache_state(lookups) -> dict[str, torch.Tensor]:
    """Copies of what training keeps between steps on this rank: caches, pins, owners' versions, clocks."""
    out = {}
    for li, lookup in enumerate(lookups):
        out[f"{li}/clock"] = torch.tensor(lookup.clock)
        for gi, g in enumerate(lookup.groups):
            for field in behaviour.CACHE_FIELDS:
                out[f"{li}/{gi}/cache.{field}"] = getattr(g.cache, field).clone()
            out[f"{li}/{gi}/pins"] = g.pins.clone()
            out[f"{li}/{gi}/versions"] = g.versions.clone()
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or that only one side has)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _shards(model) -> dict[str, torch.Tensor]:
    """This rank's shards (``state_dict``: flushes the caches' pending gradients first, a collective)."""
    return {
        f"{key}/{i}": shard.tensor.clone()
        for key, value in model.state_dict().items()
        if hasattr(value, "local_shards")
        for i, shard in enumerate(value.local_shards())
    }


def _evaluate(model, features, pipelined: bool) -> float:
    sharded = model.module.ebc
    model.eval()
    try:
        with torch.no_grad():
            if pipelined:
                ctx = sharded.create_context()
                pooled = sharded.compute_and_output_dist(ctx, sharded.input_dist(ctx, features).wait().wait()).wait()
                return float(pooled_loss(pooled))
            return float(model(features)[0])
    finally:
        model.train()


def train(rank: int, cases: list[CacheSettings], pipelined: bool, evaluating: bool) -> dict:
    """One training run; with ``evaluating``, evaluation forwards after the steps of :data:`EVALUATE_AFTER`."""
    configs, cache = behaviour.bound_configs(cases)
    model = het_model("het", configs, False, "sgd", cache, lr=behaviour.LR)
    lookups = model.module.ebc.het_lookups()
    batches = [behaviour.batch(rank, step, configs) for step in range(STEPS)]
    pipeline, iterator = (sparse_dist_pipeline(model), iter(batches)) if pipelined else (None, None)
    changed, fetched, losses = set(), 0, []
    for step in range(STEPS):
        if pipelined:
            pipeline.progress(iterator)
        else:
            loss, _ = model(batches[step])
            loss.backward()
        if evaluating and step in EVALUATE_AFTER:
            for lookup in lookups:  # the previous backward's pushes, which the evaluation's lookup applies first
                lookup.pushes.apply_arrived()
            before = cache_state(lookups)
            fetched_before = sum(s["rows_fetched"] for s in model.module.ebc.cache_stats().values())
            for extra in range(2):
                losses.append(_evaluate(model, behaviour.batch(rank, 1_000 + 10 * step + extra, configs), pipelined))
            changed.update(differing(before, cache_state(lookups)))
            fetched += sum(s["rows_fetched"] for s in model.module.ebc.cache_stats().values()) - fetched_before
    state = cache_state(lookups)
    return {
        "state": state,
        "shards": _shards(model),
        "changed_by_evaluation": sorted(changed),
        "eval_fetched": fetched,
        "eval_losses": losses,
        "ahead": all(lookup.ahead for lookup in lookups),
    }


def compare(rank: int, cases: list[CacheSettings], pipelined: bool) -> dict:
    """The run with evaluations against the run without: what differs, and what the evaluations did."""
    plain, evaluated = train(rank, cases, pipelined, False), train(rank, cases, pipelined, True)
    return {
        "differ": differing(plain["state"], evaluated["state"]) + differing(plain["shards"], evaluated["shards"]),
        "changed_by_evaluation": evaluated["changed_by_evaluation"],
        "eval_fetched": evaluated["eval_fetched"],
        "eval_losses_finite": all(torch.isfinite(torch.tensor(evaluated["eval_losses"]))),
        "evaluations": len(evaluated["eval_losses"]),
        "ahead": evaluated["ahead"],
    }


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: both loops, read in the lookup and fetched ahead."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {
            f"{reads}/{'pipeline' if pipelined else 'plain'}": compare(rank, cases, pipelined)
            for reads, cases in (("in_lookup", IN_LOOKUP_CASES), ("ahead", AHEAD_CASES))
            for pipelined in (False, True)
        }
    write_rank_result(out_dir, rank, results)
