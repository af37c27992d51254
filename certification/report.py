"""The HTML report of a certificate: verdict, checks, key, fingerprint, and inline-SVG plots
(per-item cosine distribution, a reranker's lane-vs-reference score scatter with its error
band, placement by device, latency histogram). One self-contained file: no scripts, no
external assets."""

from __future__ import annotations

import math
from pathlib import Path

import jinja2
import msgspec

from certification import svg
from certification.certificate import Certificate

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>Synapse certificate {{ c.id }} ({{ c.status }})</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222 }
table { border-collapse: collapse; margin: .5em 0 1.5em } td, th { padding: 3px 10px;
 border-bottom: 1px solid #ddd; text-align: left; vertical-align: top }
.status { font-weight: bold; padding: 2px 8px; border-radius: 4px; color: #fff }
.certified, .pass { background: #2e7d32 } .provisional { background: #ef6c00 }
.failed, .fail, .drift { background: #c62828 } .na, .info { background: #757575 }
.not-served { background: #6a1b9a }
code { font-size: 12px } .plots svg { display: block; margin: 0 0 1.5em }
</style></head><body>
<h1>{{ c.key.model }} on the {{ c.key.lane }} lane:
 <span class="status {{ c.status }}">{{ c.status }}</span></h1>
<p>Certificate <code>{{ c.id }}</code>, {{ c.created_at }}, {{ "%.1f"|format(c.duration_s) }} s.
 Quality gate: <b>{{ c.quality }}</b>; placement gate: <b>{{ c.placement }}</b>.
{% if c.failing %} Failing: <b>{{ c.failing|join(", ") }}</b>.{% endif %}
{% if c.corpus.sample_stride > 1 %} <b>Sampled run</b>: every {{ c.corpus.sample_stride }}th
 corpus item ({{ c.corpus.n_items }} of {{ c.corpus.n_total }}).{% endif %}
{% if c.overrides %} Threshold overrides: {{ c.overrides }}.{% endif %}</p>
<p id="reference">Reference (the fp32 judge): {{ c.reference }}{% if c.reference_dir %}, on
 <code>{{ c.reference_dir }}</code>{% endif %}.</p>
{% if c.provenance %}<p id="provenance">Model files: {{ c.provenance.origin }}
 <code>{{ c.provenance.repo }}</code>{% if c.provenance.revision %} at
 <code>{{ c.provenance.revision }}</code>{% endif %}{% if c.provenance.endpoint %} from
 {{ c.provenance.endpoint }}{% endif %}.</p>{% endif %}

{% if c.outputs %}<h2>Outputs</h2>
<p>Each output the model serves, judged on its own checks against its reference.</p>
<table id="outputs"><tr><th>output</th><th>verdict</th><th>checks</th><th>detail</th></tr>
{% for o in c.outputs %}<tr data-output="{{ o.output }}" data-status="{{ o.status }}">
<td>{{ o.output }}</td><td><span
 class="status {{ o.status|replace('/', '')|replace(' ', '-') }}">{{ o.status }}</span></td>
<td>{{ o.checks|join(", ") }}</td><td>{{ o.detail }}</td></tr>
{% endfor %}</table>{% endif %}

<h2>Checks</h2>
<table id="checks"><tr><th>check</th><th>gate</th><th>status</th><th>value</th>
<th>threshold</th><th>detail</th></tr>
{% for k in c.checks %}<tr><td>{{ k.name }}</td><td>{{ k.gate }}</td>
<td><span class="status {{ k.status|replace('/', '') }}">{{ k.status }}</span></td>
<td>{{ fmt(k.value) }}</td><td>{{ k.op }} {{ fmt(k.threshold) }}</td>
<td>{{ k.detail }}</td></tr>
{% endfor %}</table>

<h2>Plots</h2><div class="plots">
{{ cosine_plot|safe }}
{% if score_plot %}{{ score_plot|safe }}
<p>Each point is one pair: the lane's raw score against the reference's. The dashed line is
 where they agree; the shaded band is the error bar the pairs were judged at
 ({{ "%.4g"|format(score_bar) }}); points outside it are red. On the right, each pair's
 difference (lane - reference) against the reference score, on a scale where that band is
 visible.</p>{% endif %}
{% for plot in kind_plots %}{{ plot|safe }}
{% endfor %}{{ placement_plot|safe }}
{% if placement_note %}<p>{{ placement_note }}</p>{% endif %}
{{ latency_plot|safe }}
</div>

<h2>Key</h2>
<table id="key">{% for name, value in key.items() %}<tr><th>{{ name }}</th>
<td><code>{{ value }}</code></td></tr>{% endfor %}</table>

<h2>Fingerprint</h2>
<p><code>{{ c.fingerprint.digest }}</code> ({{ c.fingerprint.scheme }}, grid
 {{ "%.4g"|format(c.fingerprint.grid) }}, {{ c.fingerprint.n_kept }} of
 {{ c.fingerprint.n_values }} values kept).
{% if c.drift %}{% if c.drift.drifted %}<b>Drift</b>: outputs moved since
 {{ c.drift.previous_id }} ({{ c.drift.previous_created_at }}).{% else %}Stable since
 {{ c.drift.previous_id }}.{% endif %}{% if c.drift.key_changes %} Key changes:
 {{ c.drift.key_changes|join("; ") }}.{% endif %}{% endif %}</p>

<details><summary>certificate JSON</summary><pre>{{ raw }}</pre></details>
</body></html>
"""


def render(cert: Certificate) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    placement_plot, note = _placement_plot(cert)
    score_plot, score_bar = _score_plot(cert)
    return env.from_string(_TEMPLATE).render(
        c=cert,
        key=msgspec.to_builtins(cert.key),
        fmt=_fmt,
        cosine_plot=_cosine_plot(cert),
        score_plot=score_plot,
        score_bar=score_bar,
        kind_plots=_kind_plots(cert),
        placement_plot=placement_plot,
        placement_note=note,
        latency_plot=svg.histogram(
            "latency",
            cert.measurements.latencies_ms,
            f"Latency per lane request ({len(cert.measurements.latencies_ms)} requests)",
            "milliseconds per request",
            bins=20,
            y_label="requests",
        ),
        raw=msgspec.json.format(msgspec.json.encode(cert), indent=2).decode(),
    )


def write(cert: Certificate, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(cert), encoding="utf-8")
    return out


def _cosine_plot(cert: Certificate) -> str:
    m = cert.measurements
    if m.cosines:
        # 1 - cosine on a log scale: at 0.9999x a linear cosine axis shows nothing.
        cosines, bad = _finite(m.cosines)
        gaps = [math.log10(max(1.0 - c, 1e-12)) for c in cosines]
        limit = math.log10(max(1.0 - cert.thresholds.min_cosine, 1e-12))
        return svg.histogram(
            "cosine",
            gaps,
            f"Per-item cosine vs the fp32 reference ({len(gaps)} items{bad})",
            "log10(1 - cosine)   (left is better)",
            marker=limit,
            marker_label=f"min cosine {cert.thresholds.min_cosine:g}",
            y_label="items",
        )
    if not m.rerank_errors:
        return ""  # a model without a pooled vector: its outputs have their own plots
    rerank, bad = _finite(m.rerank_errors)
    errors = [math.log10(max(e, 1e-12)) for e in rerank]
    limit = math.log10(max(cert.thresholds.rerank_max_abs, 1e-12))
    return svg.histogram(
        "cosine",
        errors,
        f"Rerank |score error| vs the fp32 reference ({len(errors)} pairs{bad})",
        "log10 |lane - reference|",
        marker=limit,
        marker_label=f"max {cert.thresholds.rerank_max_abs:g}",
        y_label="pairs",
    )


_KIND_BAR = {
    "sparse": "sparse_min_cosine",
    "multivector": "multivector_min_cosine",
    "late_chunking": "late_chunk_min_cosine",
}
_KIND_WHAT = {
    "sparse": ("sparse cosine per item and route", "items"),
    "multivector": ("worst vector's cosine per item", "items"),
    "late_chunking": ("worst chunk's cosine per document", "documents"),
}


def _kind_plots(cert: Certificate) -> list[str]:
    """Per token-level output, the distribution of its per-item cosines (1 - cosine on a log
    scale), with the bar it was judged at."""
    plots = []
    for kind, m in cert.measurements.kinds.items():
        if not m.cosines or kind not in _KIND_BAR:
            continue
        cosines, bad = _finite(m.cosines)
        bar = float(getattr(cert.thresholds, _KIND_BAR[kind]))
        what, unit = _KIND_WHAT[kind]
        plots.append(
            svg.histogram(
                f"kind-{kind}",
                [math.log10(max(1.0 - c, 1e-12)) for c in cosines],
                f"{kind}: {what} vs the reference ({len(cosines)} {unit}{bad})",
                "log10(1 - cosine)   (left is better)",
                marker=math.log10(max(1.0 - bar, 1e-12)),
                marker_label=f"min cosine {bar:g}",
                y_label=unit,
            )
        )
    return plots


def _score_plot(cert: Certificate) -> tuple[str, float]:
    """A reranker's scatter of lane against reference score per pair, with the band the
    pairs were judged at ("", 0) when the certificate holds no scores (an embedder, or a
    reranker certified before they were recorded)."""
    m = cert.measurements
    if not m.rerank_lane_scores or len(m.rerank_lane_scores) != len(m.rerank_ref_scores):
        return "", 0.0
    pairs = [
        (r, lane)
        for r, lane in zip(m.rerank_ref_scores, m.rerank_lane_scores, strict=True)
        if r is not None and lane is not None and math.isfinite(r) and math.isfinite(lane)
    ]
    bar = m.rerank_bar if m.rerank_bar is not None else cert.thresholds.rerank_max_abs
    left = len(m.rerank_lane_scores) - len(pairs)
    bad = f"; {left} not a number, failing" if left else ""
    outside = sum(abs(lane - r) > bar for r, lane in pairs)
    plot = svg.scatter(
        "scores",
        [r for r, _ in pairs],
        [lane for _, lane in pairs],
        f"Lane vs reference score per pair ({len(pairs)} pairs, {outside} outside the bar{bad})",
        "reference score (fp32)",
        f"{cert.key.lane} lane score",
        band=bar,
        band_label=f"|lane - reference| <= {bar:.4g}",
    )
    return plot, bar


def _placement_plot(cert: Certificate) -> tuple[str, str]:
    m = cert.measurements
    if cert.thresholds.placement_share is None:
        return (
            svg.bars("placement", "Placement by device", [("whole graph", {"cpu": 1.0})]),
            f"n/a: the {cert.key.lane} lane runs on the CPU; the placement gate does not apply.",
        )
    if m.placement_ops:
        # Rows normalized per op type (one conv dwarfs everything else in absolute cost);
        # each label carries the op type's share of the whole graph's estimated work.
        total = sum(sum(d.values()) for d in m.placement_ops.values()) or 1.0
        ranked = sorted(m.placement_ops.items(), key=lambda kv: -sum(kv[1].values()))[:16]
        rows = [
            (
                f"{op} {100 * sum(d.values()) / total:.2g}%",
                {dev: c / (sum(d.values()) or 1.0) for dev, c in d.items()},
            )
            for op, d in ranked
        ]
        share_text = f"{m.placement_share:.4f}" if m.placement_share is not None else "?"
        return (
            svg.bars(
                "placement",
                "Placement per op type (static estimate)",
                rows,
                "fraction of the op type's work, by device",
            ),
            f"Per-op estimate over the admitted packages (top {len(rows)} op types by "
            f"work). The gate used the lane's reported share {share_text} "
            f"({m.placement_source}).",
        )
    if m.placement_share is None:
        return svg.bars("placement", "Placement", []), "The lane reported no placement."
    share = m.placement_share
    note = (
        "Share from a static estimate (not Core ML's compute plan): at most provisional; "
        "the lane reports no per-op breakdown."
        if m.placement_source != "compute_plan"
        else "Share from Core ML's MLComputePlan."
    )
    return (
        svg.bars(
            "placement",
            f"Placement, whole graph ({m.placement_source})",
            [("whole graph", {"ane": share, "cpu": 1.0 - share})],
        ),
        note,
    )


def _fmt(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.7g}"
    return str(value)


def _finite(values: list[float | None]) -> tuple[list[float], str]:
    """The plottable values, and a title note counting the others (NaN, read back as None)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    left = len(values) - len(kept)
    return kept, (f"; {left} not a number, failing" if left else "")
