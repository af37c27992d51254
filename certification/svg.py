"""Dependency-free inline SVG plots for the HTML report: a histogram, a bar chart and a
scatter against a reference.

Every plot is one `<svg data-plot=NAME>` whose `<rect class="bar">` elements carry their
data (`data-lo`/`data-hi`/`data-count`, or `data-label`/`data-value`) and a `<title>`
tooltip, so the report is checkable by parsing it and readable without JavaScript. The
scatter's points are `<circle class="point">` with `data-x`/`data-y` (and `data-outside`
when a point lies outside the band), its diagonal a `<line class="diagonal">` and its band
a `<polygon class="band" data-half-width>`; beside it the differences (`<circle
class="residual">`, lane - reference against reference) in their band (`<rect
class="band-residual">`), on an axis where a tight bar is visible.
"""

from __future__ import annotations

from html import escape

import numpy as np

W, H = 560, 220
PAD_L, PAD_R, PAD_T, PAD_B = 48, 12, 28, 40
COLORS = {"ane": "#2e7d32", "cpu": "#1565c0", "gpu": "#6a1b9a", "other": "#9e9e9e"}


def histogram(
    name: str,
    values: list[float] | np.ndarray,
    title: str,
    x_label: str,
    bins: int = 30,
    marker: float | None = None,
    marker_label: str = "",
    y_label: str = "count",
) -> str:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return _empty(name, title, "no data")
    lo, hi = float(v.min()), float(v.max())
    if marker is not None:
        lo, hi = min(lo, marker), max(hi, marker)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    top = max(int(counts.max()), 1)
    parts = [_open(name, title, v.size)]
    bw = pw / bins
    for i, c in enumerate(counts):
        h = ph * c / top
        x, y = PAD_L + i * bw, PAD_T + ph - h
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{max(bw - 1, 0.5):.1f}" '
            f'height="{h:.1f}" fill="#1565c0" data-lo="{edges[i]:.6g}" '
            f'data-hi="{edges[i + 1]:.6g}" data-count="{int(c)}">'
            f"<title>{edges[i]:.4g} .. {edges[i + 1]:.4g}: {int(c)}</title></rect>"
        )
    if marker is not None:
        mx = PAD_L + pw * (marker - lo) / (hi - lo)
        parts.append(
            f'<line class="marker" x1="{mx:.1f}" x2="{mx:.1f}" y1="{PAD_T}" '
            f'y2="{PAD_T + ph}" stroke="#c62828" stroke-dasharray="4 3" '
            f'data-value="{marker:.6g}"/>'
            # Label on the side with room: the marker often sits at the plot's edge.
            f'<text x="{mx + (-3 if mx > W / 2 else 3):.1f}" y="{PAD_T + 10}" font-size="10" '
            f'fill="#c62828" text-anchor="{"end" if mx > W / 2 else "start"}">'
            f"{escape(marker_label)}</text>"
        )
    parts.append(_axes(f"{lo:.4g}", f"{hi:.4g}", x_label, str(top), y_label))
    parts.append("</svg>")
    return "".join(parts)


def bars(
    name: str,
    title: str,
    rows: list[tuple[str, dict[str, float]]],
    x_label: str = "share of estimated work",
) -> str:
    """Horizontal stacked bars: one row per label, segments per device (values sum <= 1)."""
    if not rows:
        return _empty(name, title, "no data")
    row_h = 18
    height = PAD_T + len(rows) * (row_h + 6) + PAD_B
    pw = W - 150 - PAD_R
    parts = [_open(name, title, len(rows), height=height)]
    widest = max(max(sum(d.values()) for _, d in rows), 1e-30)  # longest row spans pw
    for i, (label, devices) in enumerate(rows):
        y = PAD_T + i * (row_h + 6)
        parts.append(f'<text x="4" y="{y + 13}" font-size="11">{escape(label[:22])}</text>')
        x = 150.0
        for device, value in devices.items():
            w = pw * value / widest
            color = COLORS.get(device, COLORS["other"])
            parts.append(
                f'<rect class="bar" x="{x:.1f}" y="{y}" width="{max(w, 0):.1f}" '
                f'height="{row_h}" fill="{color}" data-label="{escape(label)}" '
                f'data-device="{escape(device)}" data-value="{value:.6g}">'
                f"<title>{escape(label)} on {escape(device)}: {value:.4g}</title></rect>"
            )
            x += w
    legend_y = height - 12
    for j, device in enumerate(sorted({d for _, devs in rows for d in devs})):
        lx = 150 + j * 110
        parts.append(
            f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" '
            f'fill="{COLORS.get(device, COLORS["other"])}"/>'
            f'<text x="{lx + 14}" y="{legend_y}" font-size="11">{escape(device)}</text>'
        )
    parts.append(
        f'<text x="{W - PAD_R}" y="{legend_y}" font-size="10" text-anchor="end">'
        f"{escape(x_label)}</text></svg>"
    )
    return "".join(parts)


def scatter(
    name: str,
    xs: list[float] | np.ndarray,
    ys: list[float] | np.ndarray,
    title: str,
    x_label: str,
    y_label: str,
    band: float | None = None,
    band_label: str = "",
) -> str:
    """y against x on equal axes, with the diagonal y = x and, when `band` is given, the band
    |y - x| <= band around it (shaded); points outside the band are drawn red."""
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size == 0:
        return _empty(name, title, "no data")
    size = H + 120  # square plot area: the diagonal at 45 degrees
    side = size - PAD_T - PAD_B
    lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
    pad = 0.04 * (hi - lo) if hi > lo else 0.5
    lo, hi = lo - pad, hi + pad

    def px(v: float) -> float:
        return PAD_L + side * (v - lo) / (hi - lo)

    def py(v: float) -> float:
        return PAD_T + side * (hi - v) / (hi - lo)

    parts = [_open(name, title, int(x.size), height=size)]
    parts.append(f'<clipPath id="clip-{escape(name)}"><rect x="{PAD_L}" y="{PAD_T}" ')
    parts.append(f'width="{side}" height="{side}"/></clipPath>')
    clip = f'clip-path="url(#clip-{escape(name)})"'
    if band is not None:
        # The band in data units, drawn as the strip between y = x - band and y = x + band
        # (clipped to the plot): at a tight bar it is a hairline, which is the honest picture.
        corners = [(lo, lo + band), (hi, hi + band), (hi, hi - band), (lo, lo - band)]
        points = " ".join(f"{px(a):.2f},{py(b):.2f}" for a, b in corners)
        parts.append(
            f'<polygon class="band" points="{points}" fill="#c8e6c9" stroke="#2e7d32" '
            f'stroke-width="0.5" {clip} data-half-width="{band:.6g}">'
            f"<title>{escape(band_label)}</title></polygon>"
        )
    parts.append(
        f'<line class="diagonal" x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" '
        f'y2="{py(hi):.1f}" stroke="#555" stroke-dasharray="4 3"/>'
    )
    for a, b in zip(x, y, strict=True):
        out = band is not None and abs(b - a) > band
        flag = ' data-outside="1"' if out else ""
        parts.append(
            f'<circle class="point" cx="{px(a):.1f}" cy="{py(b):.1f}" r="2.2" '
            f'fill="{"#c62828" if out else "#1565c0"}" fill-opacity="0.7" '
            f'data-x="{a:.6g}" data-y="{b:.6g}"{flag}>'
            f"<title>reference {a:.5g}, lane {b:.5g}, diff {b - a:+.3g}</title></circle>"
        )
    if band_label:
        parts.append(
            f'<text x="{PAD_L + 6}" y="{PAD_T + 12}" font-size="10" fill="#2e7d32">'
            f"{escape(band_label)}</text>"
        )
    y0 = PAD_T + side
    parts.append(
        f'<line x1="{PAD_L}" y1="{y0}" x2="{PAD_L + side}" y2="{y0}" stroke="#333"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{y0}" stroke="#333"/>'
        f'<text x="{PAD_L}" y="{y0 + 14}" font-size="10">{lo:.4g}</text>'
        f'<text x="{PAD_L + side}" y="{y0 + 14}" font-size="10" text-anchor="end">{hi:.4g}</text>'
        f'<text x="{PAD_L + side / 2}" y="{y0 + 30}" font-size="11" text-anchor="middle">'
        f"{escape(x_label)}</text>"
        f'<text x="{PAD_L - 4}" y="{PAD_T + 8}" font-size="10" text-anchor="end">{hi:.4g}</text>'
        f'<text x="{PAD_L - 4}" y="{y0}" font-size="10" text-anchor="end">{lo:.4g}</text>'
        f'<text x="12" y="{(PAD_T + y0) / 2}" font-size="10" text-anchor="middle" '
        f'transform="rotate(-90 12 {(PAD_T + y0) / 2})">{escape(y_label)}</text>'
    )
    parts.append(_residuals(x, y, band, (px, lo, hi), side))
    parts.append("</svg>")
    return "".join(parts)


def _residuals(x: np.ndarray, y: np.ndarray, band: float | None, xaxis, side: float) -> str:
    """The scatter's right-hand panel: lane - reference against the reference, on an axis
    sized to the band, where a bar that is a hairline on the scores' scale is visible."""
    _, lo, hi = xaxis
    left, width = PAD_L + side + 44, W - PAD_R - (PAD_L + side + 44)
    d = y - x
    top = max(float(np.abs(d).max()), 1.5 * band if band else 0.0, 1e-12) * 1.1

    def qx(v: float) -> float:
        return left + width * (v - lo) / (hi - lo)

    def qy(v: float) -> float:
        return PAD_T + side * (top - v) / (2 * top)

    parts = []
    if band is not None:
        parts.append(
            f'<rect class="band-residual" x="{left}" y="{qy(band):.2f}" width="{width}" '
            f'height="{qy(-band) - qy(band):.2f}" fill="#c8e6c9" data-half-width="{band:.6g}"/>'
        )
    parts.append(
        f'<line x1="{left}" y1="{qy(0):.1f}" x2="{left + width}" y2="{qy(0):.1f}" '
        'stroke="#555" stroke-dasharray="4 3"/>'
    )
    for a, b in zip(x, d, strict=True):
        out = band is not None and abs(b) > band
        parts.append(
            f'<circle class="residual" cx="{qx(a):.1f}" cy="{qy(b):.1f}" r="1.8" '
            f'fill="{"#c62828" if out else "#1565c0"}" fill-opacity="0.7" '
            f'data-x="{a:.6g}" data-y="{b:.6g}"/>'
        )
    y0 = PAD_T + side
    parts.append(
        f'<line x1="{left}" y1="{y0}" x2="{left + width}" y2="{y0}" stroke="#333"/>'
        f'<line x1="{left}" y1="{PAD_T}" x2="{left}" y2="{y0}" stroke="#333"/>'
        f'<text x="{left - 3}" y="{PAD_T + 8}" font-size="10" text-anchor="end">+{top:.2g}</text>'
        f'<text x="{left - 3}" y="{y0}" font-size="10" text-anchor="end">-{top:.2g}</text>'
        f'<text x="{left + width / 2}" y="{y0 + 30}" font-size="11" text-anchor="middle">'
        "lane - reference, against reference</text>"
    )
    return "".join(parts)


def _open(name: str, title: str, n: int, height: int = H) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'viewBox="0 0 {W} {height}" data-plot="{escape(name)}" data-n="{n}" role="img">'
        f"<title>{escape(title)}</title>"
        f'<text x="{W / 2}" y="16" font-size="13" text-anchor="middle">{escape(title)}</text>'
    )


def _axes(x_lo: str, x_hi: str, x_label: str, y_top: str, y_label: str) -> str:
    y0 = H - PAD_B
    return (
        f'<line x1="{PAD_L}" y1="{y0}" x2="{W - PAD_R}" y2="{y0}" stroke="#333"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{y0}" stroke="#333"/>'
        f'<text x="{PAD_L}" y="{y0 + 14}" font-size="10">{escape(x_lo)}</text>'
        f'<text x="{W - PAD_R}" y="{y0 + 14}" font-size="10" text-anchor="end">'
        f"{escape(x_hi)}</text>"
        f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{y0 + 30}" font-size="11" '
        f'text-anchor="middle">{escape(x_label)}</text>'
        f'<text x="{PAD_L - 4}" y="{PAD_T + 8}" font-size="10" text-anchor="end">'
        f"{escape(y_top)}</text>"
        f'<text x="{PAD_L - 4}" y="{y0}" font-size="10" text-anchor="end">0</text>'
        f'<text x="12" y="{(PAD_T + y0) / 2}" font-size="10" text-anchor="middle" '
        f'transform="rotate(-90 12 {(PAD_T + y0) / 2})">{escape(y_label)}</text>'
    )


def _empty(name: str, title: str, why: str) -> str:
    return (
        _open(name, title, 0, height=60)
        + f'<text x="{W / 2}" y="40" font-size="12" text-anchor="middle">{escape(why)}'
        + "</text></svg>"
    )
