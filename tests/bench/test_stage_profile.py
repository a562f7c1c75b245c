"""The stage profile (torchrec_het_bench/stage_profile.py): operators charged to the innermost stage,
the plugin's labels and waits first, on profiler events built by hand and on a real profiled step."""

import torch
from torch.autograd.profiler import record_function

from torchrec_het_bench import stage_profile
from torchrec_het_bench.stage_profile import COMM_WAIT, summarize_events


def _rows() -> list[tuple]:
    """Two steps' events: (name, thread, start us, end us, parent index, self us)."""
    rows = []

    def add(name, parent=-1, self_us=0.0, thread=1, span=(0, 1)):
        rows.append((name, thread, span[0], span[1], parent, self_us))
        return len(rows) - 1

    for _ in range(2):
        fwd = add("## forward 3 ##", self_us=100)
        lookup = add("[lookup]_[ebc]_[het_row_replicated]", fwd, 50)
        add("aten::embedding_bag", lookup, 300)
        owners = add("## het owners' backward ##", lookup, 10)
        node = add("autograd::engine::evaluate_function: CppNode<SplitLookupFunction_rowwise_adagrad>", owners, 5)
        add("aten::index_add_", node, 200)  # the owners' label wins over the node inside it
        wait = add(COMM_WAIT, owners, 0)
        add("aten::wait_inner", wait, 400)  # a wait wins over everything around it
        bwd = add("## backward 3 ##", self_us=1000)  # DDP's wait, outside any operator
        add("aten::mm", bwd, 700)
        emb = add("autograd::engine::evaluate_function: _OutputLayoutBackward", bwd, 20)
        add("aten::index_select", emb, 80)
        add("c10d::alltoall_base_", emb, 30)
        add("gloo:all_to_all", thread=7, span=(0, 5000))  # in flight on gloo's thread
    return rows


def test_operators_are_charged_to_the_innermost_stage() -> None:
    summary = summarize_events(_rows(), steps=2)
    ms = summary["stage_ms"]
    assert ms["lookup"] == 0.35 and ms["owners' backward"] == 0.215 and ms["comm wait"] == 0.4
    assert ms["dense fwd"] == 0.1 and ms["dense bwd"] == 1.7 and ms["emb backward"] == 0.13
    assert summary["comm_wait_ms_by_stage"] == {"owners' backward": 0.4}
    assert summary["collectives_per_step"] == {"alltoall_base": 1.0}
    assert summary["waits_per_step"] == 1.0
    assert summary["in_flight_ms"] == {"all_to_all": 5.0}
    assert summary["top_ops_ms"]["lookup"]["aten::embedding_bag"] == 0.3


def test_a_real_step_is_profiled_and_merged_over_ranks() -> None:
    weight = torch.randn(50, 8, requires_grad=True)
    with stage_profile.profiled(3) as out:
        for _ in range(3):
            with record_function("## forward 0 ##"):
                loss = torch.nn.functional.embedding(torch.arange(10), weight).sum()
            with record_function("## backward 0 ##"):
                loss.backward()
            with record_function("## optimizer 0 ##"):
                weight.data.add_(weight.grad, alpha=-0.1)
    assert out["steps"] == 3 and out["stage_ms"]["dense fwd"] > 0 and out["stage_ms"]["optimizer"] > 0
    assert out["host_syncs_per_step"] == 0
    merged = stage_profile.merge_ranks([out, out])
    assert merged["stage_ms"] == {s: out["stage_ms"][s] for s in stage_profile.STAGES if s in out["stage_ms"]}
    lines = stage_profile.markdown([{"name": "x", "stage_profile": merged}])
    assert lines[2].startswith("| entry | ") and lines[-1].startswith("| x | ")
