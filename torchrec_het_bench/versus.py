"""Every entry against stock TorchRec: speed and bytes as ratios, the AUC difference with its
95% interval, and a one-line verdict.

The reference of an entry is stock table_wise of its workload under ``sparse_dist`` (TorchRec's
``TrainPipelineSparseDist``, what users train with) where the run has it, else under the entry's
own pipeline: the reference of ``convergence_vs_sparse_dist``, else of ``convergence``
(:func:`torchrec_het_bench.results.convergence`). The AUC difference and its interval are the
entry's ``auc_vs_stock`` (:mod:`torchrec_het_bench.auc_intervals`: DeLong on one run's
held-out samples, or a paired t interval over seeds). "Equal" means the interval holds 0.
"""

from torchrec_het_bench import qcomms
from torchrec_het_bench.auc_intervals import AucDifference, paired_delong, verdict_word
from torchrec_het_bench.report import by_workload, het_hit_rate, hot_row_share
from torchrec_het_bench.speed_intervals import SpeedRatio, is_twin, ratio_of, speed_over


def reference_name(entry: dict) -> str | None:
    """The name of the stock entry ``entry`` is compared with, or None (the run has none)."""
    conv = entry.get("convergence_vs_sparse_dist") or entry.get("convergence")
    return None if conv is None else conv["reference"]


def add_auc_vs_stock(entries: list[dict], scores: dict) -> None:
    """Adds ``auc_vs_stock`` (DeLong's paired interval on the held-out samples) to every entry that ran
    and has a reference other than itself.

    Args:
        entries: results.json entries, ``convergence`` already added.
        scores: entry name -> (scores, labels) of its held-out samples, in the same sample order for
            every entry of a workload.
    """

    def delong(entry: dict, reference: str) -> AucDifference:
        own, labels = scores[entry["name"]]
        ref_scores, ref_labels = scores[reference]
        if not bool((labels == ref_labels).all()):
            raise ValueError(f"{entry['name']} and {reference} were evaluated on different held-out samples")
        return paired_delong(own, ref_scores, labels)

    for entry in entries:
        reference = reference_name(entry)
        if reference is None or reference == entry["name"] or "not_run" in entry:
            continue
        entry["auc_vs_stock"] = dict(delong(entry, reference).as_dict(), reference=reference)
        add_convergence_intervals(entry, lambda ref, entry=entry: delong(entry, ref).half_width)


def add_speed_vs_stock(entries: list[dict]) -> None:
    """Adds ``speed_vs_stock`` (samples/s over the reference's, paired round by round, with its 95%
    interval: :mod:`~torchrec_het_bench.speed_intervals`) to every entry with a reference other than itself."""
    by_name = {e["name"]: e for e in entries if "not_run" not in e}
    for entry in by_name.values():
        reference = by_name.get(reference_name(entry) or "")
        if reference is None or reference is entry:
            continue
        paired = ratio_of(entry, reference)
        if paired is not None:
            entry["speed_vs_stock"] = dict(paired.as_dict(), reference=reference["name"])


def add_convergence_intervals(entry: dict, half_width) -> None:
    """Adds ``auc_half_width`` (``half_width(reference name)``) to the entry's ``convergence`` and
    ``convergence_vs_sparse_dist`` against another entry, so the convergence table shows their intervals."""
    for key in ("convergence", "convergence_vs_sparse_dist"):
        conv = entry.get(key)
        if conv is not None and conv["reference"] != entry["name"]:
            conv["auc_half_width"] = half_width(conv["reference"])


def auc_difference(entry: dict) -> AucDifference | None:
    """The entry's ``auc_vs_stock`` as an :class:`AucDifference` (None: not recorded)."""
    recorded = entry.get("auc_vs_stock")
    if recorded is None:
        return None
    return AucDifference(recorded["difference"], recorded["half_width"], recorded["method"], recorded["samples"])


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _mib_and_ratio(value: int | None, reference: int | None) -> str:
    """``7.01 (0.53×)`` in MiB, ``-`` when not measured (inter-host bytes on loopback)."""
    if value is None:
        return "-"
    ratio = _ratio(value, reference)
    return f"{value / 2**20:.2f}" + ("" if ratio is None else f" ({_times(ratio)})")


def signed(value: float) -> str:
    """``+0.0012`` / ``−0.0012`` (a real minus sign, as the report prints differences)."""
    return f"{value:+.4f}".replace("-", "−")


def auc_text(entry: dict) -> str:
    """``0.8045``, or over seeds the mean and each seed's: ``0.8045 (0.8031, 0.8062, 0.8042)``."""
    by_seed = entry.get("auc_by_seed")
    if not by_seed or len(by_seed) < 2:
        return f"{entry['auc']:.4f}"
    return f"{entry['auc']:.4f} (" + ", ".join(f"{auc:.4f}" for auc in by_seed) + ")"


def difference_text(entry: dict, reference: dict | None) -> str:
    """``−0.0003 ± 0.0008``, or the bare difference when no interval was recorded (older results)."""
    diff = auc_difference(entry)
    if diff is not None:
        return f"{signed(diff.difference)} ± {diff.half_width:.4f}"
    if reference is None:
        return "-"
    return f"{signed(entry['auc'] - reference['auc'])} (no interval recorded)"


def _speed_and_bytes(entry: dict, other: dict) -> tuple[str, float | None]:
    """The entry's speed over ``other``'s (``1.31× [1.25, 1.38] (faster)``: paired over rounds, with its
    95% interval; the medians' ratio where no rounds were recorded) and its embedding bytes per step over ``other``'s."""
    ratio, paired = speed_over(entry, other)
    speed = _times(ratio) if paired is None else f"{paired.text()} ({paired.word()})"
    return speed, _ratio(
        entry["bytes_per_step"]["embedding_cross_rank"], other["bytes_per_step"]["embedding_cross_rank"]
    )


def verdict(entry: dict, reference: dict, fastest: dict | None = None, same_codecs: dict | None = None) -> str:
    """One line: ``planned: 1.31× [1.25, 1.38] (faster) stock_table_wise at 0.53× its bytes, AUC equal
    (−0.0003 ± 0.0008); tables: het_row_replicated`` (the speed paired over rounds with its 95% interval; the
    sharding types a plugin configuration's tables got, after the ``;``). With
    ``fastest`` (the run's fastest stock entry under the entry's pipeline, when not the reference) a
    plugin entry's line also says ``1.12× the fastest stock, stock_table_wise_fp16 (1.03× its bytes)``;
    with ``same_codecs`` (stock table_wise under the quantized comms the entry ran with, when not the
    reference) ``1.35× stock under the same codecs fp16/bf16, stock_table_wise_fp16 (0.52× its bytes)``."""
    speed, emb = _speed_and_bytes(entry, reference)
    diff = auc_difference(entry)
    if diff is None:
        quality = f"AUC {signed(entry['auc'] - reference['auc'])} (no interval recorded)"
    else:
        quality = f"AUC {verdict_word(diff)} ({signed(diff.difference)} ± {diff.half_width:.4f})"
    bytes_words = "its bytes" if emb is not None else "bytes not comparable"
    line = f"{entry['name']}: {speed} {reference['name']} at {_times(emb)} {bytes_words}, {quality}"
    if entry.get("stock"):
        return line
    if fastest is not None and fastest is not reference:
        peer, peer_bytes = _speed_and_bytes(entry, fastest)
        line += f"; {peer} the fastest stock, {fastest['name']} ({_times(peer_bytes)} its bytes)"
    if same_codecs is not None and same_codecs is not reference:
        peer, peer_bytes = _speed_and_bytes(entry, same_codecs)
        line += (
            f"; {peer} stock under the same codecs {qcomms.of(entry)}, "
            f"{same_codecs['name']} ({_times(peer_bytes)} its bytes)"
        )
    return line + f"; tables: {'+'.join(entry['sharding_types'])}"  # what the plugin's configuration chose


def fastest_stock(results: dict, entry: dict) -> dict | None:
    """The stock entry of the run with the most samples/s among those of ``entry``'s workload and
    pipeline (quantized comms included), or None."""
    same = [
        c
        for c in _ran_by_name(results).values()
        if c.get("stock")
        and not is_twin(c.get("config", c["name"]))
        and c.get("workload", "dlrm") == entry.get("workload", "dlrm")
        and c.get("pipeline") == entry.get("pipeline")
    ]
    return max(same, key=lambda c: c["samples_per_s"]["median"], default=None)


def same_codecs_stock(results: dict, entry: dict) -> dict | None:
    """Stock table_wise under the quantized comms ``entry`` ran with (its workload and pipeline), or
    None: no codecs, or the run has no such entry."""
    pair = qcomms.of(entry)
    if pair is None:
        return None
    for c in _ran_by_name(results).values():
        if (
            c.get("stock")
            and qcomms.of(c) == pair
            and c["params"].get("sharding") == "table_wise"
            and c.get("workload", "dlrm") == entry.get("workload", "dlrm")
            and c.get("pipeline") == entry.get("pipeline")
        ):
            return c
    return None


def _ran_by_name(results: dict) -> dict[str, dict]:
    return {c["name"]: c for c in results["configs"] if "not_run" not in c}


def rows(results: dict) -> list[tuple[dict, dict | None]]:
    """(entry, its reference entry or None) for every entry that ran, grouped by workload."""
    entries = _ran_by_name(results)
    return [(c, entries.get(reference_name(c) or "")) for c in by_workload(results["configs"])]


def interval_note(results: dict) -> str:
    """What the ± means in this run (the methods its entries recorded)."""
    methods = sorted({c["auc_vs_stock"]["method"] for c in _ran_by_name(results).values() if "auc_vs_stock" in c})
    if not methods:
        return "AUC − stock: no interval recorded in this run"
    return (
        "AUC − stock: difference ± half-width of its 95% interval ("
        + "; ".join(methods)
        + "); equal: the interval holds 0"
    )


def table(results: dict) -> list[str]:
    """Lines of the "against stock" table: samples/s, embedding and inter-host bytes per step with their
    ratio to the reference's, the HET hit rate, the hot-row share, AUC and AUC − stock with its interval."""
    lines = [
        "| entry | sharding | samples/s | × stock | embedding MiB/step (× stock) | inter-host MiB/step (× stock) "
        "| HET hit rate (ideal LRU) | hot rows | AUC (by seed) | AUC − stock (95%) | stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, ref in rows(results):
        sps = c["samples_per_s"]["median"]
        emb, inter = c["bytes_per_step"]["embedding_cross_rank"], c.get("inter_host_bytes")
        lines.append(
            f"| {c['name']} | {'+'.join(c['sharding_types'])} | {sps:.0f} "
            f"| {_speed_and_bytes(c, ref)[0] if ref else '-'} "
            f"| {_mib_and_ratio(emb, ref and ref['bytes_per_step']['embedding_cross_rank'])} "
            f"| {_mib_and_ratio(inter, ref and ref.get('inter_host_bytes'))} "
            f"| {het_hit_rate(c)} | {hot_row_share(c)} | {auc_text(c)} "
            f"| {'0 (reference)' if ref is c else difference_text(c, ref)} | {ref['name'] if ref else '-'} |"
        )
    return lines


def verdicts(results: dict) -> list[str]:
    """One verdict line per entry that has a reference other than itself, then what the ± means."""
    lines = [
        verdict(c, ref, fastest_stock(results, c), same_codecs_stock(results, c))
        for c, ref in rows(results)
        if ref is not None and ref is not c
    ]
    if not lines:
        return []
    return [
        "verdicts against stock:",
        *(f"- {line}" for line in lines),
        "",
        *noise_lines(results),
        interval_note(results),
        "speed × stock: geometric mean of the rounds' ratios [its 95% interval over the rounds, paired round by "
        "round]; equal: the interval holds 1",
    ]


def noise_lines(results: dict) -> list[str]:
    """The run's noise floor: one line per A/A pair (an entry and its twin, the same configuration twice)."""
    pairs = results.get("noise_floor") or []
    if not pairs:
        return []
    lines = [
        f"- {p['twin']}: {SpeedRatio(p['ratio'], p['low'], p['high'], p['rounds']).text()} {p['entry']} ({p['word']})"
        for p in pairs
    ]
    return ["noise floor (A/A: the same configuration measured twice in this run):", *lines, ""]


def section(results: dict) -> str:
    """The report's opening: the "against stock" table and the verdicts (empty without a stock reference)."""
    if not any(ref is not None for _, ref in rows(results)):
        return ""
    return (
        "\n".join(
            [
                "every entry against stock TorchRec (higher samples/s, fewer bytes are better):",
                "",
                *table(results),
                "",
                *verdicts(results),
            ]
        )
        + "\n\n"
    )
