"""``python -m torchrec_het.profile``: profile row accesses of the benchmark's data and save them.

    python -m torchrec_het.profile --preset default --steps 400 --every 20 --out profile.pt
"""

import argparse
import sys

from torchrec_het.bench.model import table_configs
from torchrec_het.bench.presets import PRESETS, get_preset
from torchrec_het.data import DataConfig, open_source
from torchrec_het.replication import count_accesses, save_profile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--alpha", type=float, default=None, help="Zipf exponent (overrides the preset)")
    parser.add_argument("--data", default=None, help="Criteo data (TSV file/dir or npy); default: synthetic")
    parser.add_argument("--steps", type=int, default=400, help="training batches the profile looks at")
    parser.add_argument("--every", type=int, default=20, help="count every N-th batch (20: a 5%% sample)")
    parser.add_argument("--rank", type=int, default=0, help="whose batches to read")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where to write the profile (any iopath path)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = get_preset(args.preset, alpha=args.alpha)
    source = open_source(
        args.data,
        DataConfig(table_sizes=preset.table_sizes, batch_size=preset.batch_size, alpha=preset.alpha, seed=args.seed),
        world_size=args.world_size,
    )
    tables = table_configs(preset, source.feature_names)
    batches = (source.batch(step, args.rank, "train").sparse_features for step in range(args.steps))
    profile = count_accesses(batches, tables, every=args.every)
    save_profile(profile, args.out)
    top = sum(profile.coverage(t.name, max(1, t.num_embeddings // 100)) for t in tables) / len(tables)
    print(f"profiled {profile.batches} of {args.steps} batches ({len(tables)} tables); "
          f"the hottest 1% of rows take {top:.1%} of reads on average; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
