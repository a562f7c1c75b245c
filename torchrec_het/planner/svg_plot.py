"""A line chart as SVG text, for the what-if's sweep (the runtime draws without a plotting library)."""

import math
from html import escape

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 420, 60, 250, 20, 50
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def line_plot(
    series: dict[str, list[tuple[float, float]]],
    points: list[tuple[float, float, str]] = (),
    x_label: str = "",
    y_label: str = "",
    log2_x: bool = False,
    reference_y: float | None = 1.0,
) -> str:
    """``series``: label -> (x, y) points, drawn as lines; ``points``: (x, y, label) drawn as dots;
    ``reference_y``: a dashed horizontal line (1.0: break-even)."""
    xs = [x for s in series.values() for x, _ in s] + [x for x, _, _ in points]
    ys = [y for s in series.values() for _, y in s] + [y for _, y, _ in points]
    if reference_y is not None:
        ys.append(reference_y)
    fx = (lambda x: math.log2(x)) if log2_x else (lambda x: x)
    x0, x1 = min(map(fx, xs), default=0.0), max(map(fx, xs), default=1.0)
    y0, y1 = min(ys, default=0.0), max(ys, default=1.0)
    y0, y1 = min(y0, 0.0), y1 * 1.08 if y1 > 0 else 1.0
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (fx(x) - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="11">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>',
    ]
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 15}" text-anchor="middle">{x:g}</text>')
    for k in range(6):
        y = y0 + (y1 - y0) * k / 5
        out.append(f'<text x="{LEFT - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>')
    if reference_y is not None:
        out.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(reference_y):.1f}" y2="{py(reference_y):.1f}" '
            'stroke="#555" stroke-dasharray="4 3"/>'
        )
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(
        f'<text transform="translate(14 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">{escape(y_label)}</text>'
    )
    legend_y = TOP + 10
    for i, (label, data) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(data))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        out.append(f'<line x1="{WIDTH - RIGHT + 10}" x2="{WIDTH - RIGHT + 30}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{color}" stroke-width="2"/>')  # fmt: skip
        out.append(f'<text x="{WIDTH - RIGHT + 35}" y="{legend_y + 4}">{escape(label)}</text>')
        legend_y += 16
    for x, y, label in points:
        out.append(
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="black"><title>{escape(label)}</title></circle>'
        )
    if points:
        out.append(f'<circle cx="{WIDTH - RIGHT + 20}" cy="{legend_y}" r="4" fill="black"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 35}" y="{legend_y + 4}">measured</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
