"""A small line plot as PNG with Pillow (already installed with vLLM), for benchmark results.

Invariant: every line is drawn in its own colour with a legend entry; the y axis is log-scaled
when asked (times spanning orders of magnitude), and both axes carry their labels and ticks (a
tick at every x of a short series, nine evenly spaced ones along a long one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
           "#7f7f7f", "#bcbd22"]


def line_plot(path: Path, title: str, x_label: str, y_label: str,
              series: dict[str, Sequence[tuple[float, float]]], *, log_y: bool = False,
              size: tuple[int, int] = (900, 560)) -> Path:
    """Write ``series`` (name → (x, y) points) as a PNG line plot to ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    left, top, bottom = 90, 50, 70
    right = 70 + 8 * max((len(name) for name in series), default=10)  # room for the legend
    width, height = size[0] + right - 220, size[1]
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    points = [p for pts in series.values() for p in pts if p[1] > 0 or not log_y]
    if not points:
        raise ValueError("nothing to plot")
    xs = sorted({p[0] for p in points})
    y_of = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    y_values = [y_of(p[1]) for p in points]
    y_min, y_max = min(y_values), max(y_values)
    if log_y:
        y_min, y_max = math.floor(y_min), math.ceil(y_max)
    else:
        y_min = min(0.0, y_min)
    if y_max == y_min:
        y_max = y_min + 1
    x_min, x_max = min(xs), max(xs)
    x_span = (x_max - x_min) or 1.0

    def to_px(x: float, y: float) -> tuple[float, float]:
        px = left + (x - x_min) / x_span * (width - left - right)
        py = height - bottom - (y_of(y) - y_min) / (y_max - y_min) * (height - top - bottom)
        return px, py

    draw.text((left, 15), title, fill="black", font=font)
    draw.line([(left, top), (left, height - bottom), (width - right, height - bottom)],
              fill="black", width=1)
    ticks = range(int(y_min), int(y_max) + 1) if log_y else [
        y_min + (y_max - y_min) * k / 5 for k in range(6)]
    for tick in ticks:
        value = 10**tick if log_y else tick
        _, py = to_px(x_min, value)
        draw.line([(left - 5, py), (width - right, py)], fill="#dddddd")
        draw.text((8, py - 8), f"{value:g}", fill="black", font=font)
    # a time series has too many points to label each: then 9 evenly spaced ticks
    ticks_x = xs if len(xs) <= 12 else [x_min + x_span * k / 8 for k in range(9)]
    for x in ticks_x:
        px, _ = to_px(x, 10**y_min if log_y else y_min)
        draw.line([(px, height - bottom), (px, height - bottom + 5)], fill="black")
        draw.text((px - 20, height - bottom + 10), f"{x:.4g}", fill="black", font=font)
    draw.text((left + (width - left - right) / 2 - 60, height - 28), x_label, fill="black",
              font=font)
    draw.text((8, top - 28), y_label, fill="black", font=font)
    for n, (name, pts) in enumerate(series.items()):
        colour = COLOURS[n % len(COLOURS)]
        shown = [to_px(x, y) for x, y in sorted(pts) if y > 0 or not log_y]
        if len(shown) > 1:
            draw.line(shown, fill=colour, width=3)
        for px, py in shown if len(shown) <= 60 else ():  # markers unless a dense series
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        ly = top + 22 * n
        draw.line([(width - right + 15, ly + 8), (width - right + 40, ly + 8)], fill=colour,
                  width=3)
        draw.text((width - right + 46, ly), name, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def bar_plot(path: Path, title: str, y_label: str, groups: dict[str, dict[str, float]],
             *, size: tuple[int, int] = (900, 560)) -> Path:
    """Write grouped bars (group → bar name → value, every group the same bar names in the
    same colours, values from 0) as a PNG to ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    names = list(dict.fromkeys(n for bars in groups.values() for n in bars))
    values = [v for bars in groups.values() for v in bars.values()]
    if not names or not values:
        raise ValueError("nothing to plot")
    left, top, bottom, right = 90, 50, 70, 70 + 8 * max(len(n) for n in names)
    width, height = size[0] + right - 220, size[1]
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    plot_w, plot_h = width - left - right, height - top - bottom
    y_max = max(values) * 1.1 or 1.0
    draw.text((left, 15), title, fill="black", font=font)
    draw.line([(left, top), (left, top + plot_h), (left + plot_w, top + plot_h)], fill="black")
    for i in range(6):
        v = y_max * i / 5
        y = top + plot_h - plot_h * v / y_max
        draw.line([(left - 5, y), (left, y)], fill="black")
        draw.text((10, y - 8), f"{v:.2f}", fill="black", font=font)
    draw.text((10, top - 30), y_label, fill="black", font=font)
    group_w = plot_w / len(groups)
    bar_w = group_w * 0.8 / len(names)
    for g, (group, bars) in enumerate(groups.items()):
        x0 = left + g * group_w + group_w * 0.1
        for b, name in enumerate(names):
            if name not in bars:
                continue
            x = x0 + b * bar_w
            y = top + plot_h - plot_h * bars[name] / y_max
            draw.rectangle([x, y, x + bar_w - 2, top + plot_h], fill=COLOURS[b % len(COLOURS)])
            draw.text((x, y - 16), f"{bars[name]:.2f}", fill="black", font=font)
        draw.text((x0, top + plot_h + 10), group, fill="black", font=font)
    for b, name in enumerate(names):
        y = top + 10 + 20 * b
        draw.rectangle([width - right + 10, y, width - right + 24, y + 12],
                       fill=COLOURS[b % len(COLOURS)])
        draw.text((width - right + 30, y - 2), name, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
