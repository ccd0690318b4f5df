"""The timeline picture: device busy / idle by cause over the run, batch size and queues below.

Each pixel column covers wall / width milliseconds. The top band stacks, from the bottom, the
share of that time the device was busy (grey) and idle per cause (coloured): a run whose
gaps are far shorter than a column still shows how much of each column was idle, and why.
The bands below draw the largest value of the steps that started in each column.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from batchgen.profile.attribution import Attribution, busy
from batchgen.profile.png import Canvas, Color
from batchgen.profile.records import CAUSES, RunInfo, StepRecord

WIDTH, LEFT, RIGHT = 1400, 150, 20
BUSY: Color = (150, 150, 150)
COLORS: dict[str, Color] = dict(
    zip(
        CAUSES,
        [(66, 133, 244), (244, 160, 0), (156, 39, 176), (219, 68, 55), (15, 157, 88)],
        strict=True,
    )
)
SERIES: tuple[tuple[str, Color], ...] = (
    ("running", (30, 30, 30)),
    ("waiting", (244, 160, 0)),
    ("tokenizer_depth", (15, 157, 88)),
    ("writer_lag", (156, 39, 176)),
)
LABELS = {
    "running": "BATCH (RUNNING)",
    "waiting": "WAITING",
    "tokenizer_depth": "TOKENIZER QUEUE",
    "writer_lag": "WRITER LAG",
}
BAND = 70


def draw_timeline(records: Sequence[StepRecord], result: Attribution, info: RunInfo) -> bytes:
    """-> the PNG."""
    canvas = Canvas(WIDTH, 40 + 3 * BAND + 2 * 30 + 50)
    plot = WIDTH - LEFT - RIGHT
    wall = max(result.wall_ms, 1e-9)
    idle = result.idle_ms / wall
    title = f"RUN {info.run}  {info.device}  WALL {wall / 1e3:.2f} S  IDLE {idle:.1%}"
    canvas.text(10, 10, title, scale=2)
    y = 40
    canvas.text(10, y + BAND // 2 - 3, "DEVICE BUSY / IDLE")
    _usage_band(canvas, records, result, info, (LEFT, y, plot, BAND))
    for pair in (SERIES[:2], SERIES[2:]):
        y += BAND + 30
        _series_band(canvas, records, wall, pair, (LEFT, y, plot, BAND))
    _axis(canvas, wall, (LEFT, y + BAND + 4, plot))
    _legend(canvas, y + BAND + 30)
    return canvas.png()


def _usage_band(
    canvas: Canvas,
    records: Sequence[StepRecord],
    result: Attribution,
    info: RunInfo,
    box: tuple[int, int, int, int],
) -> None:
    x0, y0, width, height = box
    per_column = max(result.wall_ms, 1e-9) / width
    shares = {key: [0.0] * width for key in ("busy", *CAUSES)}
    spans = [b for r in records if (b := busy(r, info.on_gpu)) is not None]
    for start, end in spans:
        _spread(shares["busy"], start, end, per_column)
    for gap in result.gaps:
        _spread(shares[gap.cause], gap.start_ms, gap.end_ms, per_column)
    for column in range(width):
        bottom = y0 + height
        for key in ("busy", *CAUSES):
            size = round(height * min(1.0, shares[key][column] / per_column))
            color = BUSY if key == "busy" else COLORS[key]
            canvas.rect(x0 + column, bottom - size, x0 + column + 1, bottom, color)
            bottom -= size
    _frame(canvas, box)


def _spread(column_ms: list[float], start: float, end: float, per_column: float) -> None:
    """Add the interval's time to the columns it covers."""
    last = len(column_ms) - 1
    first = min(last, int(start / per_column))
    for column in range(first, min(last, int(end / per_column)) + 1):
        low, high = column * per_column, (column + 1) * per_column
        column_ms[column] += max(0.0, min(end, high) - max(start, low))


def _series_band(
    canvas: Canvas,
    records: Sequence[StepRecord],
    wall: float,
    series: Sequence[tuple[str, Color]],
    box: tuple[int, int, int, int],
) -> None:
    x0, y0, width, height = box
    values = {name: _columns(records, name, wall, width) for name, _ in series}
    top = max([1, *(v for column in values.values() for v in column if v is not None)])
    for i, (name, color) in enumerate(series):
        canvas.text(10, y0 + 4 + 14 * i, LABELS[name], color)
        points = [
            (x0 + x, y0 + height - 1 - round((height - 5) * v / top))
            for x, v in enumerate(values[name])
            if v is not None
        ]
        for (ax, ay), (bx, by) in pairwise(points):
            canvas.line(ax, ay, bx, by, color)
    canvas.text(x0 - 6 * len(str(top)) - 4, y0, str(top))
    canvas.text(x0 - 10, y0 + height - 7, "0")
    _frame(canvas, box)


def _columns(records: Sequence[StepRecord], name: str, wall: float, width: int) -> list[int | None]:
    """The largest value of the steps starting in each column; a column without a step keeps
    the value before it (None until the first value, and for a run without that gauge)."""
    out: list[int | None] = [None] * width
    for record in records:
        v = getattr(record, name)
        if v is None:
            continue
        column = min(width - 1, max(0, int(record.host_schedule_ms / wall * width)))
        out[column] = v if out[column] is None else max(out[column], v)
    last = None
    for column in range(width):
        last = out[column] = out[column] if out[column] is not None else last
    return out


def _axis(canvas: Canvas, wall: float, where: tuple[int, int, int]) -> None:
    x0, y, width = where
    ticks = 8
    for i in range(ticks + 1):
        x = x0 + round(i * (width - 1) / ticks)
        canvas.rect(x, y, x + 1, y + 4, (0, 0, 0))
        canvas.text(x - 12, y + 7, f"{wall * i / ticks / 1e3:.2f}S")


def _legend(canvas: Canvas, y: int) -> None:
    x = 10
    for name, color in (("busy", BUSY), *COLORS.items()):
        canvas.rect(x, y, x + 12, y + 9, color)
        x = canvas.text(x + 16, y + 1, name) + 18


def _frame(canvas: Canvas, box: tuple[int, int, int, int]) -> None:
    x0, y0, width, height = box
    edge: Color = (0, 0, 0)
    canvas.rect(x0 - 1, y0 - 1, x0 + width + 1, y0, edge)
    canvas.rect(x0 - 1, y0 + height, x0 + width + 1, y0 + height + 1, edge)
    canvas.rect(x0 - 1, y0, x0, y0 + height, edge)
    canvas.rect(x0 + width, y0, x0 + width + 1, y0 + height, edge)
