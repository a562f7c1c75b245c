"""``python -m torchrec_het_bench.scaling``: the scaling page, docs/scaling.md, from measured runs and the what-if.

    python -m torchrec_het_bench.scaling run      # smoke preset at 2, 3, 4, 8 ranks, flat and as 2 emulated hosts
    python -m torchrec_het_bench.scaling page     # docs/scaling.md and docs/scaling.svg

``run`` writes the validation runs into ``docs/results/scaling/`` (one results.json each, with the
step model's prediction beside every entry; :mod:`torchrec_het_bench.scaling_runs`). ``page`` reads
them and the default-preset runs in ``docs/results/`` that carry predictions, runs the what-if
sweep (:mod:`torchrec_het.plan`) on the default preset's tables at this machine's compute figures,
and writes the page (:mod:`torchrec_het_bench.scaling_page`): which figures are measured and which
predicted, the model's error on the runs, where the plugin wins as ranks grow and by how much, and
the comparison at two public reference points.
"""

import argparse
import sys

from torchrec_het_bench.scaling_page import write_page
from torchrec_het_bench.scaling_runs import run_validation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "page"))
    args = parser.parse_args(argv)
    if args.what == "run":
        run_validation()
    else:
        print(f"wrote {write_page()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
