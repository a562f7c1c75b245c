"""A 2-rank smoke run of the benchmark writes results in the agreed shape.

The run mixes workloads: the DLRM's stock configurations and the sequence model's,
interleaved on the command line, all under the default pipeline (TorchRec's
TrainPipelineSparseDist), with held-out AUC every 6 steps; a second run trains stock
table_wise in the plain loop, evaluating only at the end (the smoke preset's default).
"""

import math

import pytest
import torch

from torchrec_het_bench.data.sequence import TABLE_FEATURES
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.step_time import STEP_PARTS
from torchrec_het_bench.workloads import open_workload_source
from torchrec_het_testing.bench_runs import run_smoke_bench

PHASES = {"fwd_ids", "fwd_emb", "bwd_grad", "dense_allreduce", "other"}
COLLECTIVES = {"all_to_all", "reduce_scatter", "all_gather", "all_reduce", "broadcast"}
DLRM = ["stock_table_wise", "stock_table_wise_fp16", "stock_table_wise_int8", "stock_row_wise", "stock_dp_small"]
SEQUENCE = ["seq_stock_table_wise", "seq_stock_row_wise"]
RUN = [
    "stock_table_wise",
    "seq_stock_table_wise",
    "stock_table_wise_fp16",
    "stock_table_wise_int8",
    "stock_row_wise",
    "seq_stock_row_wise",
    "stock_dp_small",
]


def _bench(out, configs: list[str], *extra: str) -> dict:
    data, run = run_smoke_bench(out, configs, *extra)
    # The benchmark's own warnings are fixed (and TorchRec's about what it must do filtered narrowly): none shows.
    warned = [line for line in run.stderr.splitlines() if "warning" in line.lower()]
    assert not warned, "\n".join(warned[:20])
    assert "| stock_table_wise |" in run.stdout
    assert "| HET hit rate (ideal LRU) | hot rows |" in run.stdout
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).stat().st_size > 0, name
    return data


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return _bench(tmp_path_factory.mktemp("bench"), RUN, "--eval-every", "6")  # the default pipeline


@pytest.fixture(scope="module")
def plain_results(tmp_path_factory) -> dict:
    return _bench(tmp_path_factory.mktemp("bench_plain"), ["stock_table_wise"], "--pipeline", "plain")


def test_top_level_shape(results: dict) -> None:
    assert results["preset"] == "smoke"
    assert results["world_size"] == 2
    links = results["network"].pop("links")
    assert results["network"] == {
        "mode": "loopback",
        "gbit": None,
        "hosts": 1,
        "delay_ms": None,
        "delay_ms_effective": None,
        "tcp": None,
    }
    # what the plugin's planner measures on the run's ranks (one host: within it only)
    assert (links["intra_source"], links["inter_source"]) == ("measured", "assumed") and links["intra_gbit"] > 0
    assert set(links["probe"]) == {"seconds", "rounds", "bytes_sent", "intra"}
    assert set(results["versions"]) >= {"torch", "torchrec", "fbgemm_gpu", "torchrec_het"}
    assert [c["name"] for c in results["configs"]] == RUN
    preset = get_preset("smoke")
    assert results["batch_size_per_rank"] == preset.batch_size
    assert results["sequence"]["item_rows"] == preset.sequence.item_rows
    assert results["sequence"]["batch_size_per_rank"] == preset.sequence.batch_size


def test_each_configuration(results: dict) -> None:
    preset = get_preset("smoke")
    for c in results["configs"]:
        assert c["stock"] is True and c["workload"] == ("sequence" if c["name"] in SEQUENCE else "dlrm")
        assert c["batch_size_per_rank"] == preset.batch_size_of(c["workload"])
        sps = c["samples_per_s"]
        assert 0 < sps["p10"] <= sps["median"] <= sps["p90"]
        b = c["bytes_per_step"]
        assert set(b) >= PHASES | {"embedding_total", "embedding_cross_rank"}
        assert all(isinstance(b[k], int) and b[k] >= 0 for k in b)
        # Per-step figures are rounded one by one (sequence lengths vary, so they need not be integers).
        assert b["embedding_cross_rank"] == pytest.approx(sum(b[p] for p in PHASES - {"dense_allreduce"}), abs=4)
        assert b["embedding_total"] >= b["embedding_cross_rank"]
        assert b["dense_allreduce"] > 0  # the dense MLPs are always all-reduced
        assert set(c["embedding_cross_rank_by_collective"]) == COLLECTIVES
        assert sum(c["embedding_cross_rank_by_collective"].values()) == pytest.approx(b["embedding_cross_rank"], abs=8)
        assert c["inter_host_bytes"] is None
        assert 0.0 <= c["auc"] <= 1.0 and 0 < c["loss"] < float("inf")
        assert len(c["peak_rss_mb"]) == 2 and all(m > 0 for m in c["peak_rss_mb"])


def test_every_configuration_trains_under_sparse_dist_and_splits_its_step_time(results: dict) -> None:
    assert results["pipeline"] == "sparse_dist"
    for c in results["configs"]:
        assert c["params"]["pipeline"] == "sparse_dist"
        ms = c["step_ms"]
        assert set(ms) == set(STEP_PARTS), ms
        assert all(math.isfinite(v) and v >= 0 for v in ms.values()), (c["name"], ms)
        assert all(ms["total"] >= ms[p] for p in STEP_PARTS), (c["name"], ms)
        # The hooks fire under the pipeline for bags and sequences: forward, backward, waits.
        assert ms["emb_fwd"] > 0 and ms["emb_bwd"] > 0 and ms["comm_wait"] > 0, (c["name"], ms)
        assert len(c["losses"]) == c["measured_steps"]


def test_sparse_dist_trains_exactly_like_the_plain_loop(results: dict, plain_results: dict) -> None:
    piped = next(c for c in results["configs"] if c["name"] == "stock_table_wise")
    (plain,) = plain_results["configs"]
    assert plain["params"]["pipeline"] == "plain" and plain_results["pipeline"] == "plain"
    # The pipeline reorders when each batch's input dist runs, not what a step computes:
    # the same loss at every measured step (each after the same warm-up steps), the same
    # bytes per step (fixed-size batches), the same held-out AUC. The piped run also
    # evaluated after steps 6 and 12 with batches in flight, the plain one did not: the
    # evaluations changed nothing.
    assert [step for step, _ in piped["auc_curve"]] == [6, 12, 18]
    assert [step for step, _ in plain["auc_curve"]] == [18] and plain_results["eval_every"] == 0
    assert piped["auc_curve"][-1][1] == piped["auc"]
    assert piped["losses"] == plain["losses"]
    assert piped["bytes_per_step"] == plain["bytes_per_step"]
    assert piped["auc"] == plain["auc"]


def test_sharding_types_show_in_bytes(results: dict) -> None:
    by_name = {c["name"]: c for c in results["configs"]}
    tw, rw, dp = by_name["stock_table_wise"], by_name["stock_row_wise"], by_name["stock_dp_small"]
    assert tw["sharding_types"] == ["table_wise"]
    assert rw["sharding_types"] == ["row_wise"]
    # Same data, same starting weights, same optimizer: the two plans train the same model.
    assert abs(tw["auc"] - rw["auc"]) < 2e-3 and abs(tw["loss"] - rw["loss"]) < 2e-3
    assert set(dp["sharding_types"]) == {"data_parallel", "table_wise"}
    # Table-wise pools on the owner and returns pooled rows with all_to_all; row-wise
    # returns partial pools with reduce_scatter.
    assert tw["embedding_cross_rank_by_collective"]["reduce_scatter"] == 0
    assert tw["bytes_per_step"]["fwd_emb"] > 0 and tw["bytes_per_step"]["bwd_grad"] > 0
    assert rw["embedding_cross_rank_by_collective"]["reduce_scatter"] > 0
    # Replicated small tables move no rows; their gradients are all-reduced whole every
    # step (DDP around their lookup), which counts as embedding traffic, not dense.
    assert dp["bytes_per_step"]["fwd_emb"] < tw["bytes_per_step"]["fwd_emb"]
    assert dp["bytes_per_step"]["dense_allreduce"] == tw["bytes_per_step"]["dense_allreduce"]
    preset = get_preset("smoke")
    dp_bytes = sum(rows * preset.embedding_dim * 4 for rows in preset.table_sizes if rows <= preset.dp_max_rows)
    ws = results["world_size"]
    # An all-reduce of N bytes sends 2N(ws-1)/ws to the other ranks from each rank.
    assert dp["embedding_cross_rank_by_collective"]["all_reduce"] == 2 * dp_bytes * (ws - 1)


def test_torchrec_quantized_comms_halve_the_pooled_bytes_and_train_alike(results: dict) -> None:
    by_name = {c["name"]: c for c in results["configs"]}
    tw, fp16 = by_name["stock_table_wise"], by_name["stock_table_wise_fp16"]
    assert fp16["stock"] and fp16["sharding_types"] == ["table_wise"] and fp16["params"]["qcomms"] == "fp16/bf16"
    # fp16 forward, bf16 backward: 2 bytes an element where fp32 sends 4; the ids are not quantized.
    assert 2 * fp16["bytes_per_step"]["fwd_emb"] == tw["bytes_per_step"]["fwd_emb"]
    assert 2 * fp16["bytes_per_step"]["bwd_grad"] == tw["bytes_per_step"]["bwd_grad"]
    assert fp16["bytes_per_step"]["fwd_ids"] == tw["bytes_per_step"]["fwd_ids"]
    assert abs(fp16["auc"] - tw["auc"]) < 5e-3 and abs(fp16["loss"] - tw["loss"]) < 5e-3


def test_int8_codecs_send_fewer_pooled_bytes_than_fp16(results: dict) -> None:
    by_name = {c["name"]: c for c in results["configs"]}
    fp16, int8 = by_name["stock_table_wise_fp16"], by_name["stock_table_wise_int8"]
    assert int8["params"]["qcomms"] == "int8/int8"
    # row-wise int8: 32 one-byte values and an 8-byte scale and bias a row, counted as embeddings (uint8)
    assert 0 < int8["bytes_per_step"]["fwd_emb"] < 0.7 * fp16["bytes_per_step"]["fwd_emb"]
    assert int8["bytes_per_step"]["fwd_ids"] == fp16["bytes_per_step"]["fwd_ids"]


def _measured_ids(preset, world_size: int) -> list[tuple[int, str, torch.Tensor]]:
    """(rank, table, ids looked up) of every measured step of the sequence workload."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors; immune to OpenMP spinning on busy cores
    try:
        source = open_workload_source("sequence", preset, world_size, seed=0)
        found = []
        for step in range(preset.warmup_steps, preset.total_steps):
            for rank in range(world_size):
                kjt = source.batch(step, rank).sparse_features
                for table, features in TABLE_FEATURES.items():
                    found.append((rank, table, torch.cat([kjt[f].values() for f in features])))
    finally:
        torch.set_num_threads(threads)
    return found


def _remote_ids_per_step(preset, looked_up, owner_of) -> float:
    """Ids per measured step (all ranks) that ``owner_of(table, ids)`` places on another rank than the batch's."""
    remote = sum(int((owner_of(table, ids) != rank).sum()) for rank, table, ids in looked_up)
    return remote / preset.measured_steps


def test_sequence_bytes_are_embedding_traffic_and_match_the_ids(results: dict) -> None:
    by_name = {c["name"]: c for c in results["configs"]}
    tw, rw = by_name["seq_stock_table_wise"], by_name["seq_stock_row_wise"]
    assert tw["sharding_types"] == ["table_wise"] and rw["sharding_types"] == ["row_wise"]
    # Same data, same starting weights: both plans train the same model.
    assert abs(tw["auc"] - rw["auc"]) < 2e-3 and abs(tw["loss"] - rw["loss"]) < 2e-3
    assert tw["auc"] > 0.5  # learning has begun (18 steps are too few for much of the planted signal)
    preset, ws = get_preset("smoke"), results["world_size"]
    row_bytes = preset.sequence.embedding_dim * 4
    rows = {"item": preset.sequence.item_rows, "category": preset.sequence.category_rows}
    for c in (tw, rw):
        b = c["bytes_per_step"]
        assert b["fwd_ids"] > 0 and b["fwd_emb"] > 0 and b["other"] == 0
        # Unpooled: one row per looked-up id goes out, one gradient row per id comes back.
        assert b["bwd_grad"] == b["fwd_emb"]
        assert c["embedding_cross_rank_by_collective"]["all_to_all"] == b["embedding_cross_rank"]
        assert b["dense_allreduce"] == tw["bytes_per_step"]["dense_allreduce"] > 0
    # Row-wise: an id's row lives on rank id // ceil(rows / ws); every id looked up from
    # another rank returns its row (dim x 4 bytes).
    looked_up = _measured_ids(preset, ws)
    blocks = {table: -(-n // ws) for table, n in rows.items()}
    expected_rw = _remote_ids_per_step(preset, looked_up, lambda table, ids: ids // blocks[table])
    assert rw["bytes_per_step"]["fwd_emb"] == round(expected_rw * row_bytes)
    # Table-wise: each table lives whole on one rank; the planner picks which.
    placements = [{"item": a, "category": b} for a in range(ws) for b in range(ws)]
    expected_tw = {
        round(
            _remote_ids_per_step(preset, looked_up, lambda table, ids, p=p: torch.full_like(ids, p[table])) * row_bytes
        )
        for p in placements
    }
    assert tw["bytes_per_step"]["fwd_emb"] in expected_tw


def test_markdown_rows_have_every_column(results: dict) -> None:
    from torchrec_het_bench.report import markdown_table

    table = markdown_table(results)
    main_table, rest = table.split("\n\nstep time, ms per step")
    step_table, convergence_table = rest.split("\n\nconvergence: held-out AUC")
    assert "pipeline `sparse_dist`" in main_table and "not run" not in main_table
    for part, columns in ((main_table, 16), (step_table, 7), (convergence_table, 11)):
        rows = [line for line in part.splitlines() if line.startswith("|")]
        assert len(rows) == 2 + len(results["configs"])
        assert {line.count("|") for line in rows} == {columns + 1}
        # Grouped by workload, in order of first appearance: the DLRM rows, then the sequence rows.
        assert [line.split("|")[2].strip() for line in rows[2:]] == DLRM + SEQUENCE
        assert [line.split("|")[1].strip() for line in rows[2:]] == ["dlrm"] * len(DLRM) + ["sequence"] * len(SEQUENCE)
    assert "sequence workload: item table" in table
    assert "CPU: 2 ranks x 1 intra-op thread(s)" in main_table or "CPU: 2 ranks x " in main_table
    # Stock entries have neither a HET cache nor replicated rows: both cells blank.
    rows = [line.split("|") for line in main_table.splitlines() if line.startswith("|")][2:]  # below the header
    assert rows and all([cell.strip() for cell in cells[12:14]] == ["", ""] for cells in rows)
