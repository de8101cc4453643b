"""Server-rendered SVG geometry for the overview chart: no chart library, no script, so it
works under a strict CSP and renders identically in the page and in the live stream."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runs.dashboard.selectors import HourlyActivity

REASON_COLORS = {
    "killed": "#7c3aed",
    "max_steps": "#dc2626",
    "tool_denied": "#ea580c",
    "max_seconds": "#d97706",
    "max_usd": "#ca8a04",
    "max_tool_calls": "#65a30d",
    "loop_detected": "#db2777",
    "no_progress": "#0891b2",
    "repeated_error": "#4f46e5",
    "agent_stopped": "#64748b",
}
OTHER_COLOR = "#94a3b8"

WIDTH, HEIGHT = 1100, 230
LEFT, RIGHT, TOP, BOTTOM = 36, 8, 10, 26


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    color: str
    title: str


@dataclass(frozen=True)
class Tick:
    pos: float
    label: str


@dataclass(frozen=True)
class LegendItem:
    label: str
    color: str
    total: int


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_bottom: int
    bars: list[Rect]
    started_points: str  # an SVG polyline "x,y x,y ..."
    started_dots: list[Rect]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    legend: list[LegendItem]
    total_started: int
    total_stops: int


def _nice_max(value: int) -> int:
    """The smallest 2 x (1, 2 or 5 x 10^k) at or above value, so both gridlines are round."""
    half = max(value, 4) / 2
    magnitude = 10 ** math.floor(math.log10(half))
    for step in (1, 2, 5, 10):
        if step * magnitude >= half:
            return int(2 * step * magnitude)
    return int(20 * magnitude)


def activity_chart(activity: HourlyActivity) -> Chart:
    n = len(activity.hours)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    slot = plot_w / max(n, 1)
    bar_w = slot * 0.62
    totals = [sum(counts[i] for counts in activity.stops.values()) for i in range(n)]
    top = _nice_max(max([*totals, *activity.started, 1]))

    def y(value: float) -> float:
        return TOP + plot_h - plot_h * value / top

    bars: list[Rect] = []
    for i, hour in enumerate(activity.hours):
        base = 0
        x = LEFT + i * slot + (slot - bar_w) / 2
        for reason, counts in activity.stops.items():
            if counts[i]:
                color = REASON_COLORS.get(reason, OTHER_COLOR)
                bars.append(Rect(round(x, 1), round(y(base + counts[i]), 1), round(bar_w, 1),
                                 round(y(base) - y(base + counts[i]), 1), color,
                                 f"{hour:{activity.tick}} UTC: {counts[i]} stopped by {reason}"))
                base += counts[i]
    centers = [LEFT + i * slot + slot / 2 for i in range(n)]
    points = " ".join(f"{cx:.1f},{y(v):.1f}" for cx, v in zip(centers, activity.started,
                                                               strict=True))
    dots = [Rect(round(cx - 2, 1), round(y(v) - 2, 1), 4, 4, "#0f172a",
                 f"{hour:{activity.tick}} UTC: {v} runs started")
            for cx, v, hour in zip(centers, activity.started, activity.hours, strict=True)]
    y_ticks = [Tick(round(y(v), 1), str(v)) for v in (0, top // 2, top)]
    x_ticks = [Tick(round(centers[i], 1), f"{activity.hours[i]:{activity.tick}}")
               for i in range(0, n, activity.tick_every)]
    legend = [LegendItem(reason, REASON_COLORS.get(reason, OTHER_COLOR), sum(counts))
              for reason, counts in activity.stops.items()]
    return Chart(
        width=WIDTH, height=HEIGHT, plot_left=LEFT, plot_right=WIDTH - RIGHT,
        plot_bottom=TOP + plot_h, bars=bars, started_points=points, started_dots=dots,
        y_ticks=y_ticks, x_ticks=x_ticks, legend=legend,
        total_started=sum(activity.started), total_stops=sum(totals),
    )
