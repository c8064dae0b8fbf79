"""Charts drawn on the server as inline SVG: no script, no build step, readable without CSS.

Each bucket is a ``<g class="bucket">`` carrying its numbers as ``data-`` attributes and a
``<title>`` (the browser's tooltip), so what the chart shows can be read back exactly.
"""

from __future__ import annotations

from datetime import datetime, timezone

from markupsafe import Markup, escape

from supervisor.ui.timeseries import Bucket, Series

WIDTH, HEIGHT = 620, 150
LEFT, BOTTOM, TOP = 44, 20, 8  # room for the axis labels


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (an axis maximum)."""
    if value <= 0:
        return 1
    step = 1.0
    while step * 10 <= value:
        step *= 10
    while step > value * 10:
        step /= 10
    return next(m * step for m in (1, 2, 5, 10) if m * step >= value)


def _clock(epoch: float, window_seconds: int) -> str:
    """A time of day, with the date when the window spans days."""
    moment = datetime.fromtimestamp(epoch, timezone.utc)
    return moment.strftime("%H:%M" if window_seconds < 86400 else "%d %b %H:%M")


def _frame(series: Series, top_label: str, body: list[str], css: str, summary: str) -> Markup:
    plot_h = HEIGHT - BOTTOM - TOP
    first, last = series.buckets[0].start, series.buckets[-1].start + series.window.bucket
    middle = series.buckets[len(series.buckets) // 2].start
    axis = [
        f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH}" y2="{TOP + plot_h}"/>',
        f'<line class="grid" x1="{LEFT}" y1="{TOP}" x2="{WIDTH}" y2="{TOP}"/>',
        f'<text class="tick" x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">{escape(top_label)}</text>',
        f'<text class="tick" x="{LEFT - 4}" y="{TOP + plot_h}" text-anchor="end">0</text>',
        f'<text class="tick" x="{LEFT}" y="{HEIGHT - 4}">{_clock(first, series.window.seconds)} UTC</text>',
        f'<text class="tick" x="{_slot(series, len(series.buckets) // 2)[0]:.1f}" y="{HEIGHT - 4}" '
        f'text-anchor="middle">{_clock(middle, series.window.seconds)}</text>',
        f'<text class="tick" x="{WIDTH}" y="{HEIGHT - 4}" text-anchor="end">now</text>',
    ]
    return Markup(f'<svg class="chart {css}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(summary)}" '
                  f'data-window="{series.window.name}" data-start="{first:.0f}" data-end="{last:.0f}">'
                  + "".join(axis + body) + "</svg>")


def _slot(series: Series, i: int) -> tuple[float, float]:
    """The x and width of bucket ``i``."""
    width = (WIDTH - LEFT) / len(series.buckets)
    return LEFT + i * width, width


def _tooltip(series: Series, bucket: Bucket, what: str) -> str:
    start = _clock(bucket.start, series.window.seconds)
    end = _clock(bucket.start + series.window.bucket, series.window.seconds)
    return f"<title>{start}–{end} UTC: {escape(what)}</title>"


def throughput(series: Series) -> Markup:
    """Stacked bars per bucket: deliveries below, failures above."""
    plot_h = HEIGHT - BOTTOM - TOP
    top = nice_ceiling(max((b.attempts for b in series.buckets), default=0))
    body = []
    for i, b in enumerate(series.buckets):
        x, w = _slot(series, i)
        ok_h, bad_h = plot_h * b.delivered / top, plot_h * b.failed / top
        base = TOP + plot_h
        body.append(
            f'<g class="bucket" data-start="{b.start:.0f}" data-delivered="{b.delivered}" data-failed="{b.failed}">'
            + _tooltip(series, b, f"{b.delivered} delivered, {b.failed} failed")
            + f'<rect class="hit" x="{x:.1f}" y="{TOP}" width="{w:.1f}" height="{plot_h}"/>'
            + f'<rect class="ok" x="{x + w * .1:.1f}" y="{base - ok_h:.1f}" width="{w * .8:.1f}" height="{ok_h:.1f}"/>'
            + f'<rect class="bad" x="{x + w * .1:.1f}" y="{base - ok_h - bad_h:.1f}" width="{w * .8:.1f}" '
              f'height="{bad_h:.1f}"/></g>')
    return _frame(series, f"{top:g}", body, "throughput",
                  f"last {series.window.name}: {series.delivered} delivered, {series.failed} failed")


def latency(series: Series) -> Markup:
    """The average response time per bucket as a line, the slowest as a faint bar behind it."""
    plot_h = HEIGHT - BOTTOM - TOP
    top = nice_ceiling(max((b.latency_max_ms or 0 for b in series.buckets), default=0))
    body, points = [], []
    for i, b in enumerate(series.buckets):
        x, w = _slot(series, i)
        base = TOP + plot_h
        if b.latency_avg_ms is None:
            body.append(f'<g class="bucket" data-start="{b.start:.0f}">'
                        + _tooltip(series, b, "no answer") + "</g>")
            continue
        avg, peak = b.latency_avg_ms, b.latency_max_ms or 0
        point = (x + w / 2, base - plot_h * avg / top)
        points.append(f"{point[0]:.1f},{point[1]:.1f}")
        body.append(
            f'<g class="bucket" data-start="{b.start:.0f}" data-latency-avg="{avg:.1f}" data-latency-max="{peak}">'
            + _tooltip(series, b, f"average {avg:.0f} ms, slowest {peak} ms")
            + f'<rect class="peak" x="{x + w * .2:.1f}" y="{base - plot_h * peak / top:.1f}" width="{w * .6:.1f}" '
              f'height="{plot_h * peak / top:.1f}"/>'
            + f'<circle class="avg" cx="{point[0]:.1f}" cy="{point[1]:.1f}" r="2"/></g>')
    if len(points) > 1:
        body.append(f'<polyline class="avg" points="{" ".join(points)}"/>')
    slowest = max((b.latency_max_ms or 0 for b in series.buckets), default=0)
    return _frame(series, f"{top / 1000:g} s" if top >= 1000 else f"{top:g} ms", body, "latency",
                  f"response time, last {series.window.name}: slowest {slowest} ms")
