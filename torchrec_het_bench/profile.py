"""``python -m torchrec_het_bench.profile``: profile row accesses of the benchmark's data and save them.

    python -m torchrec_het_bench.profile --preset default --steps 400 --every 20 --out profile.pt

To profile your own batches, use :class:`AccessProfiler` (``observe`` each sampled
``KeyedJaggedTensor`` of one rank, then ``save``).
"""

import argparse
import sys

from torchrec_het.replication.profile import AccessProfiler
from torchrec_het_bench.flags import float_above, int_at_least

__all__ = ["AccessProfiler", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from torchrec_het_bench.presets import PRESETS

    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument(
        "--alpha", type=float_above(0, inclusive=True), default=None, help="Zipf exponent, >= 0 (overrides the preset)"
    )
    parser.add_argument("--data", default=None, help="Criteo data (TSV file/dir or npy); default: synthetic")
    parser.add_argument("--steps", type=int, default=400, help="training batches the profile looks at (>= 1)")
    parser.add_argument("--every", type=int, default=20, help="count every N-th batch (20: a 5%% sample; >= 1)")
    parser.add_argument("--rank", type=int, default=0, help="whose batches to read")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--out", required=True, help="where to write the profile (any iopath path)")
    args = parser.parse_args(argv)
    for flag in ("steps", "every", "world_size"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)} (an empty profile prices nothing)"
            )
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must lie in [0, --world-size {args.world_size}), got {args.rank}")
    return args


def main(argv: list[str] | None = None) -> int:
    from torchrec_het_bench.data import DataConfig, open_source
    from torchrec_het_bench.model import table_configs
    from torchrec_het_bench.presets import get_preset

    args = parse_args(argv)
    preset = get_preset(args.preset, alpha=args.alpha)
    source = open_source(
        args.data,
        DataConfig(table_sizes=preset.table_sizes, batch_size=preset.batch_size, alpha=preset.alpha, seed=args.seed),
        world_size=args.world_size,
    )
    tables = table_configs(preset, source.feature_names)
    profiler = AccessProfiler(tables)
    for step in range(0, args.steps, args.every):
        profiler.observe(source.batch(step, args.rank, "train").sparse_features)
    profile = profiler.save(args.out)
    top = sum(profile.coverage(t.name, max(1, t.num_embeddings // 100)) for t in tables) / len(tables)
    print(
        f"profiled {profile.batches} of {args.steps} batches ({len(tables)} tables); "
        f"the hottest 1% of rows take {top:.1%} of reads on average; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
