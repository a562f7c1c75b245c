"""CPU time of one FBGEMM TBE step on this stack: ``python -m torchrec_het_bench.tbe_cost``.

Times the forward and the forward + fused backward of one
``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (one rank's share of the default preset under
table_wise: 13 tables of 100k rows, dim 64, 2048 bags of one id each) in process CPU seconds, one
thread, so a busy machine changes the figure little. It is how the two supported stacks' TBE
costs were compared (docs/benchmarks.md): run it with each stack's python.
"""

import argparse
import sys
import time

import torch


def _cpu_tbe(optimizer: str, tables: int, rows: int, dim: int, batch: int):
    """(a CPU TBE of ``tables`` tables of ``rows`` x ``dim`` with the fused ``optimizer``, its
    random ids, its offsets: ``batch`` bags of one id per table)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=getattr(EmbOptimType, optimizer),
        learning_rate=0.05,
    )
    generator = torch.Generator().manual_seed(0)
    indices = torch.randint(0, rows, (tables * batch,), generator=generator)
    return tbe, indices, torch.arange(0, tables * batch + 1)


def step_cpu_ms(optimizer: str, tables: int, rows: int, dim: int, batch: int, steps: int) -> dict[str, float]:
    """Median CPU milliseconds of a forward and of a forward + backward (after 5 unmeasured steps)."""
    tbe, indices, offsets = _cpu_tbe(optimizer, tables, rows, dim, batch)
    medians = {}
    for phase in ("forward", "forward+backward"):
        times = []
        for _ in range(5 + steps):
            start = time.process_time()
            out = tbe(indices, offsets)
            if phase == "forward+backward":
                out.sum().backward()
            times.append(time.process_time() - start)
        measured = sorted(times[5:])
        medians[phase] = 1e3 * measured[len(measured) // 2]
    return medians


def lookup_seconds_per_id(table_sizes, dim: int, batch: int, steps: int = 8) -> float:
    """Wall seconds per id of a TBE lookup's forward, backward and fused row-wise Adagrad update,
    4 tables of the smallest of ``table_sizes`` rows (at most 100k) and width ``dim``, ``batch``
    bags of one id each (the step model's probe, :mod:`torchrec_het_bench.prediction`)."""
    tables, rows = 4, min(min(table_sizes), 100_000)
    tbe, indices, offsets = _cpu_tbe("EXACT_ROWWISE_ADAGRAD", tables, rows, dim, batch)
    times = []
    for _ in range(3 + steps):
        start = time.perf_counter()
        tbe(indices, offsets).sum().backward()
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[len(times[3:]) // 2] / (tables * batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.tbe_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="EXACT_ROWWISE_ADAGRAD", help="an fbgemm EmbOptimType name")
    parser.add_argument("--tables", type=int, default=13)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import fbgemm_gpu

    medians = step_cpu_ms(args.optimizer, args.tables, args.rows, args.dim, args.batch, args.steps)
    versions = f"torch {torch.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}"
    for phase, ms in medians.items():
        print(f"{versions}: {args.optimizer} {phase}: {ms:.2f} CPU ms (median of {args.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
