"""The compute the planner prices, measured at plan time on the ranks that will train.

Two short probes, each repeated in rounds whose median is used: a FBGEMM TBE lookup (forward,
backward and fused row-wise Adagrad update) of the model's width, per id; and the dense part: every
``nn.Linear`` of the model outside its embedding modules, rebuilt at its shape, run forward and
backward with an Adagrad step on random rows at the batch size (a model without one: a square
layer of 256, and 6 flops per dense parameter and sample). A probe whose rounds spread more than
:data:`SPREAD` is measured once more; if it still spreads, it is not steady: its median is not
priced alone, and the planner keeps the plugin's plan only where it wins across the rounds' range
(``*_bounds``; :func:`~torchrec_het.planner.cost_model.decide`).
"""

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

SPREAD = 2.0  # a probe's slowest round over its fastest, at most
DENSE_FLOPS_PER_PARAM = 6.0  # per sample: forward 2, backward 4
MAX_PROBE_ROWS = 100_000
PROBE_TABLES = 2
MATMUL_WIDTH = 256


@dataclass(frozen=True)
class ComputeProbe:
    """What the compute probe measured (identical on every rank after :func:`agree`).

    Attributes:
        lookup_s_per_id: a TBE lookup's forward, backward and fused update, seconds per id.
        dense_s_per_sample: the dense part's forward and backward, seconds per sample.
        dense_params: the model's parameters outside its embedding modules.
        seconds: what the probe took (the slowest rank's).
        steady: both probes' rounds agreed within :data:`SPREAD` (else the medians are not priced alone).
        why: when not steady, which probe spread and how much.
        lookup_bounds, dense_bounds: the fastest and slowest rounds' figures (low, high); None: the
            median only (stated figures).
        stated: the figures were given (``compute=`` or ``TORCHREC_HET_STEP_COMPUTE``), not measured.
    """

    lookup_s_per_id: float
    dense_s_per_sample: float
    dense_params: int
    seconds: float
    steady: bool = True
    why: str = ""
    lookup_bounds: tuple[float, float] | None = None
    dense_bounds: tuple[float, float] | None = None
    stated: bool = False

    def describe(self) -> str:
        origin = "stated" if self.stated else f"measured at plan time, {self.seconds:.2f} s"
        line = (
            f"compute ({origin}): lookup {self.lookup_s_per_id * 1e9:.0f} ns/id, "
            f"dense {self.dense_s_per_sample * 1e6:.1f} us/sample ({self.dense_params} parameters)"
        )
        return line if self.steady else f"{line}; NOT STEADY: {self.why}"


def parse_step_compute(text: str, origin: str) -> tuple[float, float]:
    """``"LOOKUP_NS,DENSE_US"``: a lookup's forward, backward and update in ns per id, and the dense
    part's in us per sample; returns them in seconds.

    Raises:
        ValueError: naming ``origin``.
    """
    fields = text.split(",")
    values = []
    for field in fields if len(fields) == 2 else ():
        try:
            values.append(float(field))
        except ValueError:
            break
    if len(values) != 2 or not all(0 < v < float("inf") for v in values):
        raise ValueError(f"{origin} must be 'LOOKUP_NS,DENSE_US' (ns per id, us per sample, both > 0), got {text!r}")
    return values[0] * 1e-9, values[1] * 1e-6


def dense_parameters(module: nn.Module) -> int:
    """Parameters of ``module`` outside its EmbeddingBagCollections / EmbeddingCollections."""
    embedding = {id(p) for m in module.modules() if _is_embedding_module(m) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in embedding)


def table_configs(module: nn.Module) -> dict:
    """Every EmbeddingBagCollection / EmbeddingCollection table of ``module``: name -> its config
    (once, however many modules wrapping it expose it)."""
    configs = {}
    for m in module.modules():
        for getter in ("embedding_bag_configs", "embedding_configs"):
            if hasattr(m, getter):
                configs.update({t.name: t for t in getattr(m, getter)()})
    return configs


def embedding_shape(module: nn.Module) -> tuple[int, int]:
    """(the median width, rounded to a multiple of 4; the most rows) of ``module``'s embedding tables ((16, 1000) without any)."""
    configs = table_configs(module).values()
    dims, rows = [c.embedding_dim for c in configs], [c.num_embeddings for c in configs]
    if not dims:
        return 16, 1000
    return max(4, 4 * round(statistics.median(dims) / 4)), max(rows)  # FBGEMM's widths: multiples of 4


def measure_compute(module: nn.Module, batch: int, rounds: int = 5) -> ComputeProbe:
    """Measures the lookup's and the dense part's compute for ``module`` at ``batch`` samples per rank."""
    start = time.perf_counter()
    dim, rows = embedding_shape(module)
    params = dense_parameters(module)
    lookup, lookup_why, lookup_bounds = _steady(
        lambda: _lookup_rounds(dim, min(rows, MAX_PROBE_ROWS), batch, rounds), "lookup"
    )
    shapes = linear_shapes(module)
    if shapes:
        step, rate_why, (fast, slow) = _steady(lambda: _linear_rounds(shapes, batch, rounds), "dense layers")
        dense, dense_bounds = step / batch, (fast / batch, slow / batch)
    else:
        rate, rate_why, (low, high) = _steady(lambda: _matmul_rounds(batch, rounds), "dense matmul")
        seconds = DENSE_FLOPS_PER_PARAM * params
        dense = seconds / rate if rate > 0 else 0.0
        dense_bounds = (seconds / high, seconds / low) if low > 0 else (dense, dense)
    why = "; ".join(w for w in (lookup_why, rate_why) if w)
    return ComputeProbe(lookup, dense, params, time.perf_counter() - start, not why, why, lookup_bounds, dense_bounds)


def agree(probe: ComputeProbe, group: dist.ProcessGroup) -> ComputeProbe:
    """Every rank's probe made one: the slowest rank's figures (it sets the step), steady only where
    every rank's was. A collective: every rank of ``group`` calls it."""
    lookup_bounds = probe.lookup_bounds or (probe.lookup_s_per_id,) * 2
    dense_bounds = probe.dense_bounds or (probe.dense_s_per_sample,) * 2
    figures = torch.tensor(
        [probe.lookup_s_per_id, probe.dense_s_per_sample, probe.seconds, 0.0 if probe.steady else 1.0,
         *lookup_bounds, *dense_bounds],
        dtype=torch.float64,
    )  # fmt: skip
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    lookup, dense, seconds, unsteady, *bounds = (float(v) for v in figures)
    why = probe.why or ("another rank's probe was not steady" if unsteady else "")
    return ComputeProbe(
        lookup, dense, probe.dense_params, seconds, not unsteady, why, (bounds[0], bounds[1]), (bounds[2], bounds[3])
    )


def _steady(measure, name: str) -> tuple[float, str, tuple[float, float]]:
    """The median of ``measure()``'s rounds, measured again once when they spread; (figure, why not
    steady, (lowest, highest) of the rounds the figure came from: both measures' when not steady)."""
    spread, seen = 0.0, []
    for _ in range(2):
        rounds = measure()
        seen += rounds
        spread = max(rounds) / min(rounds) if min(rounds) > 0 else float("inf")
        if spread <= SPREAD:
            return statistics.median(rounds), "", (min(rounds), max(rounds))
    why = f"the {name} probe's rounds spread {spread:.1f}x twice (at most {SPREAD:g}x)"
    return statistics.median(rounds), why, (min(seen), max(seen))


def _lookup_rounds(dim: int, rows: int, batch: int, rounds: int) -> list[float]:
    """Seconds per id of a CPU TBE step (forward, backward, fused row-wise Adagrad), one per round."""
    from torchrec_het._tbe import cpu_probe_kernel

    tbe = cpu_probe_kernel(PROBE_TABLES, rows, dim)
    ids = PROBE_TABLES * batch
    indices = torch.randint(0, rows, (ids,), generator=torch.Generator().manual_seed(0))
    offsets = torch.arange(0, ids + 1)
    tbe(indices, offsets).sum().backward()  # warm-up
    return [_median_seconds(lambda: tbe(indices, offsets).sum().backward()) / ids for _ in range(rounds)]


def linear_shapes(module: nn.Module) -> list[tuple[int, int]]:
    """(in, out) features of every ``nn.Linear`` of ``module`` outside its embedding modules."""
    embedding = {id(m) for e in module.modules() if _is_embedding_module(e) for m in e.modules()}
    return [
        (m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in embedding
    ]


def _linear_rounds(shapes: list[tuple[int, int]], batch: int, rounds: int) -> list[float]:
    """Seconds of the layers' forward, backward and Adagrad step at ``batch`` rows, one per round."""
    generator = torch.Generator().manual_seed(0)
    layers = nn.ModuleList(nn.Linear(i, o) for i, o in shapes)
    inputs = [torch.randn(batch, i, generator=generator) for i, _ in shapes]
    optimizer = torch.optim.Adagrad(layers.parameters(), lr=0.01)

    def step() -> None:
        loss = sum(torch.relu(layer(x)).sum() for layer, x in zip(layers, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up
    return [_median_seconds(step) for _ in range(rounds)]


def _matmul_rounds(batch: int, rounds: int) -> list[float]:
    """Flops per second of a dense layer's forward and backward at ``batch`` rows, one per round."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, MATMUL_WIDTH, generator=generator, requires_grad=True)
    w = torch.randn(MATMUL_WIDTH, MATMUL_WIDTH, generator=generator, requires_grad=True)
    flops = 3 * 2.0 * batch * MATMUL_WIDTH * MATMUL_WIDTH  # y = x w; its gradients for x and w
    (x @ w).sum().backward()  # warm-up
    return [flops / _median_seconds(lambda: (x @ w).sum().backward()) for _ in range(rounds)]


def _median_seconds(step, repeats: int = 3) -> float:
    """The median wall time of ``repeats`` calls of ``step``."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _is_embedding_module(module: nn.Module) -> bool:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return isinstance(module, EmbeddingBagCollection | EmbeddingCollection)
