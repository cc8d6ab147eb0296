"""A small line plot as PNG with Pillow (already installed with vLLM), for benchmark results.

Invariant: every line is drawn in its own colour with a legend entry; the y axis is log-scaled
when asked (times spanning orders of magnitude), and both axes carry their labels and ticks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]


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
    for x in xs:
        px, _ = to_px(x, 10**y_min if log_y else y_min)
        draw.line([(px, height - bottom), (px, height - bottom + 5)], fill="black")
        draw.text((px - 20, height - bottom + 10), f"{x:g}", fill="black", font=font)
    draw.text((left + (width - left - right) / 2 - 60, height - 28), x_label, fill="black",
              font=font)
    draw.text((8, top - 28), y_label, fill="black", font=font)
    for n, (name, pts) in enumerate(series.items()):
        colour = COLOURS[n % len(COLOURS)]
        shown = [to_px(x, y) for x, y in sorted(pts) if y > 0 or not log_y]
        if len(shown) > 1:
            draw.line(shown, fill=colour, width=3)
        for px, py in shown:
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        ly = top + 22 * n
        draw.line([(width - right + 15, ly + 8), (width - right + 40, ly + 8)], fill=colour,
                  width=3)
        draw.text((width - right + 46, ly), name, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
