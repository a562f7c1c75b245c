"""Where a training step's time goes, stage by stage, from ``torch.profiler`` (``--profile-steps N``).

Each entry's last N warm-up steps (never measured ones) run under ``torch.profiler`` (CPU). Every
operator the step's thread ran is charged, by its self time, to the innermost stage that encloses
it, found from the ``record_function`` labels TorchRec and the plugin put on their stages and from
the autograd node that runs it:

- ``input dist``: the sharded modules' input dists and their awaitables (``[splits_dist]``, the
  splits and ids awaitables' waits, the pipeline's ``start_sparse_data_dist``);
- ``lookup``: ``[lookup]``, less what the plugin labels inside it;
- ``output dist``: ``[output_dist]``, its awaitable's wait (the bags or rows finished);
- ``owners' backward``: the plugin's deferred owner backward (``## het owners' backward ##``),
  wherever it runs;
- ``replica sync``: applying a replica sync (``## het replica sync ##``);
- ``emb backward``: autograd nodes of the embedding modules (TorchRec's dists and kernels, the
  plugin's exchanges and output layout);
- ``comm wait``: blocked in ``Work.wait()`` (the profiler labels it ``## comm wait ##`` while it runs);
- ``optimizer``, ``zero_grad``: the pipeline's own labels;
- ``dense fwd`` / ``dense bwd``: the rest of the pipeline's forward / backward (DDP's wait for
  its all-reduce at the end of the backward included);
- ``other``: what none of these enclose.

Beside the stages: collectives issued per step by family (``c10d::`` operators), waits on a
collective's result (``Work.wait()`` calls: the blocking collectives), host syncs per
step (``torchrec_het_testing.host_syncs``), and how long gloo's threads had each kind of
collective in flight per step (all-to-all, all-reduce, all-gather: the link's share of the step).
"""

import re
import statistics
from collections import Counter, defaultdict
from contextlib import contextmanager

STAGES = ("input dist", "lookup", "output dist", "owners' backward", "replica sync", "emb backward", "comm wait",
          "dense fwd", "dense bwd", "optimizer", "zero_grad", "other")  # fmt: skip
COMM_WAIT = "## comm wait ##"
TOP_OPS = 12  # operators kept per stage in results.json (the most expensive)
# innermost label wins; checked in order against each enclosing event's name
_LABELS = (
    (re.compile(r"^## comm wait ##$"), "comm wait"),
    (re.compile(r"^## het owners' backward ##$"), "owners' backward"),
    (re.compile(r"^## het replica sync ##$"), "replica sync"),
    (
        re.compile(
            r"^\[splits_dist\]|SplitsAwaitable wait|_CountsGathered wait|KJTListAwaitable wait|_Ids wait"
            r"|^## (start|wait)_sparse_data_dist"
        ),
        "input dist",
    ),  # fmt: skip
    (re.compile(r"^\[lookup\]"), "lookup"),
    (
        re.compile(
            r"^\[output_dist|CollectionAwaitable wait|_Bags wait|_SequenceOutput wait|PooledEmbeddingsAwaitable"
            r"|SequenceEmbeddingsAwaitable"
        ),
        "output dist",
    ),  # fmt: skip
    (re.compile(r"^## optimizer"), "optimizer"),
    (re.compile(r"^## zero_grad"), "zero_grad"),
    (re.compile(r"^## backward"), "dense bwd"),
    (re.compile(r"^## forward"), "dense fwd"),
)
_NODE = re.compile(r"^autograd::engine::evaluate_function: (.*)")
_EMBEDDING_NODES = re.compile(
    r"All2All|AllToAll|Alltoall|ReduceScatter|AllGather|SplitLookupFunction|Embedding|Pooled|KJT|_OutputLayout"
    r"|_Receive|_Send|_BlockRows|_HotRows|_Partials"
)
_COLLECTIVE = re.compile(r"^c10d::(\w+?)_*$")
_IN_FLIGHT = re.compile(r"^gloo:(\w+)$")


_FIRST = 3  # the first labels (comm wait, then the plugin's own) win over any node or label inside them


def stage_of(chain: list[str], first: int = _FIRST) -> str:
    """The stage of an operator from its enclosing events' names, innermost first: a wait, then the
    plugin's own labels, wherever they are in the chain; else the innermost node or label."""
    for pattern, stage in _LABELS[:first]:
        if any(pattern.search(name) for name in chain):
            return stage
    for name in chain:
        node = _NODE.match(name)
        if node is not None and _EMBEDDING_NODES.search(node.group(1)):
            return "emb backward"
        for pattern, stage in _LABELS:
            if pattern.search(name):
                return stage
    return "other"


def summarize_events(rows: list[tuple], steps: int) -> dict:
    """Stage times and counts per step from profiler events ``(name, thread, start_us, end_us,
    parent index or -1, self_us)``; the step's thread is the one that ran the pipeline's forward."""
    step_thread = next((r[1] for r in rows if r[0].startswith("## forward")), None)
    if step_thread is None:  # a plain loop: the thread with the most time
        busy = Counter()
        for r in rows:
            busy[r[1]] += r[5]
        step_thread = busy.most_common(1)[0][0] if busy else None
    stages, ops = Counter(), defaultdict(Counter)
    collectives, in_flight, waits = Counter(), Counter(), Counter()
    waits_made = 0  # Work.wait() calls: the step's thread blocked on a collective's result
    for index, (name, thread, start, end, parent, self_us) in enumerate(rows):
        if thread != step_thread:
            flight = _IN_FLIGHT.match(name)
            if flight is not None and parent == -1:
                in_flight[flight.group(1)] += end - start
            continue
        chain, at = [], index
        while at != -1:
            chain.append(rows[at][0])
            at = rows[at][4]
        stage = stage_of(chain)
        stages[stage] += self_us
        ops[stage][name] += self_us
        if stage == "comm wait":  # and where it waited
            waits[stage_of([n for n in chain if n != COMM_WAIT], first=0)] += self_us
        collective = _COLLECTIVE.match(name)
        if collective is not None:
            collectives[collective.group(1)] += 1
        if name == COMM_WAIT:
            waits_made += 1
    per_step = 1e-3 / steps  # us -> ms per step
    return {
        "steps": steps,
        "stage_ms": {s: round(stages[s] * per_step, 3) for s in STAGES if stages[s]},
        "top_ops_ms": {
            s: {op: round(us * per_step, 3) for op, us in ops[s].most_common(TOP_OPS) if us * per_step >= 0.05}
            for s in STAGES
            if stages[s]
        },
        "comm_wait_ms_by_stage": {s: round(waits[s] * per_step, 3) for s in STAGES if waits[s]},
        "collectives_per_step": {k: n / steps for k, n in sorted(collectives.items())},
        "waits_per_step": waits_made / steps,
        "in_flight_ms": {k: round(us * per_step, 3) for k, us in sorted(in_flight.items())},
    }


def _event_rows(profiler) -> list[tuple]:
    events = profiler.events()
    index = {id(e): i for i, e in enumerate(events)}
    return [
        (e.name, e.thread, e.time_range.start, e.time_range.end, index.get(id(e.cpu_parent), -1),
         e.self_cpu_time_total)
        for e in events
    ]  # fmt: skip


@contextmanager
def _labelled_waits():
    """``Work.wait()`` runs inside ``record_function(COMM_WAIT)`` while the block runs."""
    from torch.autograd.profiler import record_function
    from torch.distributed.distributed_c10d import Work

    original = Work.wait

    def wait(self, *args, **kwargs):
        with record_function(COMM_WAIT):
            return original(self, *args, **kwargs)

    Work.wait = wait
    try:
        yield
    finally:
        Work.wait = original


@contextmanager
def profiled(steps: int):
    """Profiles the block (``steps`` training steps); yields a dict that holds the summary on exit
    (:func:`summarize_events`) plus ``host_syncs_per_step``."""
    from torch.profiler import ProfilerActivity, profile

    from torchrec_het_testing.host_syncs import count_host_syncs, total

    out: dict = {}
    with _labelled_waits(), count_host_syncs(where=True) as syncs:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            yield out
    out.update(summarize_events(_event_rows(profiler), steps))
    out["host_syncs_per_step"] = total(syncs) / steps
    out["sync_sites"] = {k: v for k, v in syncs.most_common(40) if k.startswith("at:")}


def merge_ranks(per_rank: list[dict]) -> dict:
    """One entry's stage profile: the mean over ranks of every figure (and each rank's step total)."""

    def mean(key: str) -> dict:
        keys = sorted({k for p in per_rank for k in p[key]})
        return {k: round(statistics.fmean(p[key].get(k, 0.0) for p in per_rank), 3) for k in keys}

    stage_ms = mean("stage_ms")
    return {
        "steps": per_rank[0]["steps"],
        "stage_ms": {s: stage_ms[s] for s in STAGES if s in stage_ms},
        "total_ms_by_rank": [round(sum(p["stage_ms"].values()), 3) for p in per_rank],
        "comm_wait_ms_by_stage": mean("comm_wait_ms_by_stage"),
        "collectives_per_step": mean("collectives_per_step"),
        "waits_per_step": statistics.fmean(p.get("waits_per_step", 0.0) for p in per_rank),
        "host_syncs_per_step": statistics.fmean(p["host_syncs_per_step"] for p in per_rank),
        "in_flight_ms": mean("in_flight_ms"),
        "top_ops_ms": per_rank[0]["top_ops_ms"],  # rank 0's
        "host_sync_sites": per_rank[0].get("sync_sites"),  # rank 0's: file:line -> syncs in the profiled steps
    }


def markdown(entries: list[dict]) -> list[str]:
    """The stage table of a run's entries that were profiled (lines; empty when none was)."""
    profiled_entries = [e for e in entries if e.get("stage_profile")]
    if not profiled_entries:
        return []
    present = [s for s in STAGES if any(s in e["stage_profile"]["stage_ms"] for e in profiled_entries)]
    steps = profiled_entries[0]["stage_profile"]["steps"]
    lines = [
        f"stage profile, ms per step (torch.profiler over {steps} unmeasured steps of each entry, mean over "
        "ranks; self time of the step's thread by innermost stage: docs/measuring.md#stage-profile); collectives "
        "issued, waits on a collective's result (Work.wait) and host syncs per step and rank; gloo's threads' "
        "time with each collective in flight",
        "",
        "| entry | " + " | ".join(present) + " | total | collectives | waits | host syncs | in flight |",
        "|---|" + "---|" * (len(present) + 5),
    ]
    for e in profiled_entries:
        p = e["stage_profile"]
        cells = [f"{p['stage_ms'].get(s, 0.0):.2f}" for s in present]
        calls = ", ".join(f"{k} {v:g}" for k, v in p["collectives_per_step"].items())
        flight = ", ".join(f"{k} {v:.1f}" for k, v in p["in_flight_ms"].items())
        total = statistics.fmean(p["total_ms_by_rank"])
        lines.append(f"| {e['name']} | " + " | ".join(cells) + f" | {total:.1f} | {calls} | "
                     f"{p.get('waits_per_step', 0):g} | {p['host_syncs_per_step']:g} | {flight} |")  # fmt: skip
    return lines
