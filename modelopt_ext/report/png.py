"""Dependency-free PNG charts: a grouped bar chart drawn on an RGB canvas with a built-in 5x7 bitmap font.

    grouped_bars_png("err.png", title="Weight error per layer", categories=["L1", "L2"],
                     series={"ours": [0.01, 0.02], "baseline": [0.03, 0.05]}, ylabel="rel. MSE", log_y=True)

Pure Python (stdlib zlib/struct only); the same inputs give the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import struct
import tempfile
import zlib

logger = logging.getLogger(__name__)

# Printable ASCII 32..126, 5 column bytes per glyph (10 hex digits); bit 0 is the top row, rows 0-6 hold the
# body and row 7 the descenders (g j p q y).
FONT = (
    "0000000000" "00005F0000" "0007000700" "147F147F14" "242A7F2A12" "2313086462" "3649562050" "0000070000"
    "001C224100" "0041221C00" "2A1C7F1C2A" "08083E0808" "0050300000" "0808080808" "0060600000" "2010080402"
    "3E5149453E" "00427F4000" "4261514946" "2141454B31" "1814127F10" "2745454539" "3C4A494930" "0171090503"
    "3649494936" "064949291E" "0036360000" "0056360000" "0814224100" "1414141414" "0041221408" "0201510906"
    "324979413E" "7C1211127C" "7F49494936" "3E41414122" "7F4141221C" "7F49494941" "7F09090901" "3E4149497A"
    "7F0808087F" "00417F4100" "2040413F01" "7F08142241" "7F40404040" "7F020C027F" "7F0408107F" "3E4141413E"
    "7F09090906" "3E4151215E" "7F09192946" "2649494932" "01017F0101" "3F4040403F" "1F2040201F" "3F4038403F"
    "6314081463" "0708700807" "6151494543" "007F414100" "0204081020" "0041417F00" "0402010204" "4040404040"
    "0001020400" "2054545478" "7F48444438" "3844444428" "384444487F" "3854545418" "087E090102" "18A4A4A478"
    "7F08040478" "00447D4000" "4080847D00" "7F10284400" "00417F4000" "7C04180478" "7C08040478" "3844444438"
    "FC24242418" "18242424FC" "7C08040408" "4854545424" "043F444020" "3C4040207C" "1C2040201C" "3C4030403C"
    "4428102844" "9CA0A0A07C" "4464544C44" "0008364100" "00007F0000" "0041360800" "0804081008"
)
GLYPH_ADVANCE = 6  # 5 columns + 1 blank

WHITE, TEXT, AXIS, GRID = (255, 255, 255), (25, 25, 25), (70, 70, 70), (228, 228, 228)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
HEIGHT, MIN_WIDTH, MAX_WIDTH = 420, 640, 2400


def glyph_columns(ch: str) -> bytes:
    """The 5 column bytes of `ch`; characters outside printable ASCII draw as '?'."""
    code = ord(ch) if 32 <= ord(ch) <= 126 else ord("?")
    start = (code - 32) * 10
    return bytes.fromhex(FONT[start:start + 10])


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of `text` drawn at `scale`."""
    return max(0, GLYPH_ADVANCE * len(text) - 1) * scale


def clip_text(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, a trailing '~' marking the cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars - 1] + "~" if max_chars >= 2 else text[:max(max_chars, 0)]


def format_number(value: float) -> str:
    """Compact tick label: 0, 0.012, 250, 1500, 1.2e-05."""
    if value == 0:
        return "0"
    if 1e3 <= abs(value) < 1e5 and value == round(value):
        return f"{value:.0f}"
    return f"{value:.3g}"


class Canvas:
    """An RGB image held as a bytearray, origin top-left."""

    def __init__(self, width: int, height: int, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x0, y0, x1, y1, color) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, int(x0)), min(self.width, int(x1))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        if x0 >= x1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, color=TEXT, scale: int = 1, vertical: bool = False) -> None:
        """Draw `text` with its top-left corner at (x, y); `vertical` text reads upwards from (x, y)."""
        for i, ch in enumerate(text):
            for cx, bits in enumerate(glyph_columns(ch)):
                for ry in range(8):
                    if bits >> ry & 1:
                        along, across = (i * GLYPH_ADVANCE + cx) * scale, ry * scale
                        if vertical:
                            self.rect(x + across, y - along - scale, x + across + scale, y - along, color)
                        else:
                            self.rect(x + along, y + across, x + along + scale, y + across + scale, color)

    def png_bytes(self) -> bytes:
        """The canvas as an 8-bit RGB PNG (filter type 0 on every row)."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + self.pixels[y * stride:(y + 1) * stride] for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(raw, 9)) \
            + png_chunk(b"IEND", b"")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC-32 of type + data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_atomic(path, data: bytes) -> None:
    """Write `data` to a temporary file next to `path`, then rename it over `path`."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def linear_ticks(lo: float, hi: float) -> list[float]:
    """4-6 evenly spaced round ticks (steps 1, 2, 2.5, 5 x 10^k) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + 1.0
    exponent = math.floor(math.log10((hi - lo) / 5))
    for power in range(exponent, exponent + 3):
        for mantissa in (1, 2, 2.5, 5):
            step = mantissa * 10.0 ** power
            first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
            if last - first <= 5:
                return [i * step for i in range(first, last + 1)]
    raise AssertionError("unreachable: a step of 10^(k+2) always fits")


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks for a log axis over positive [lo, hi]: whole decades, with 2/5 or 3 in between for short ranges."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    last = max(last, first + 1)
    decades = last - first
    if decades <= 2:
        mantissas = (1, 2, 5) if decades == 1 else (1, 3)
        return [m * 10.0 ** e for e in range(first, last) for m in mantissas] + [10.0 ** last]
    step = math.ceil(decades / 5)
    return [10.0 ** e for e in range(first, first + step * math.ceil(decades / step) + 1, step)]


def grouped_bars_png(path, *, title: str, categories: list[str], series: dict[str, list[float]], ylabel: str,
                     log_y: bool = False) -> None:
    """Write a grouped bar chart to `path` (PNG): one group per category, one coloured bar per series.

    NaN values draw no bar, +-inf is clipped to the axis range, and with `log_y` values <= 0 draw no bar.
    Raises ValueError when there are no categories or series, or a series' length differs from the categories'.
    """
    categories = [str(c) for c in categories]
    if not categories or not series:
        raise ValueError("grouped_bars_png needs at least one category and one series")
    values = {}
    for name, vals in series.items():
        vals = [float(v) for v in vals]
        if len(vals) != len(categories):
            raise ValueError(f"series {name!r} has {len(vals)} values for {len(categories)} categories")
        values[str(name)] = vals
    finite = [v for vals in values.values() for v in vals if math.isfinite(v) and (v > 0 or not log_y)]
    if log_y:
        ticks = log_ticks(min(finite), max(finite)) if finite else [1.0, 10.0]
        transform = math.log10
    else:
        ticks = linear_ticks(min([0.0, *finite]), max([0.0, *finite]))
        transform = float
    axis_lo, axis_hi = transform(ticks[0]), transform(ticks[-1])
    tick_labels = [format_number(t) for t in ticks]

    n, k = len(categories), len(values)
    left = 16 + max(text_width(label) for label in tick_labels) + 8
    wanted = min(max(len(c) for c in categories), 12)  # label characters a group should have room for
    group_px = max(14, 8 * k + 6, text_width("x" * wanted) + 8)
    width = int(min(MAX_WIDTH, max(MIN_WIDTH, left + 20 + n * group_px)))
    top, bottom, right = 56, HEIGHT - 34, width - 20
    plot_h, plot_w = bottom - top, right - left
    canvas = Canvas(width, HEIGHT)

    def y_of(value: float) -> float:
        position = (transform(value) - axis_lo) / (axis_hi - axis_lo)
        return bottom - min(1.0, max(0.0, position)) * plot_h

    title = clip_text(title, (width - 20) // (2 * GLYPH_ADVANCE))
    canvas.text((width - text_width(title, 2)) // 2, 8, title, scale=2)
    ylabel = clip_text(ylabel, plot_h // GLYPH_ADVANCE)
    canvas.text(3, top + (plot_h + text_width(ylabel)) // 2, ylabel, vertical=True)

    names = [clip_text(name, max(3, ((width - 40) // k - 30) // GLYPH_ADVANCE)) for name in values]
    entry_widths = [10 + 4 + text_width(name) + 16 for name in names]
    x = max(4, (width - sum(entry_widths) + 16) // 2)
    for j, (name, entry_w) in enumerate(zip(names, entry_widths)):
        canvas.rect(x, 32, x + 10, 42, PALETTE[j % len(PALETTE)])
        canvas.text(x + 14, 33, name)
        x += entry_w

    for tick, label in zip(ticks, tick_labels):
        ty = round(y_of(tick))
        canvas.rect(left, ty, right, ty + 1, GRID)
        canvas.rect(left - 4, ty, left, ty + 1, AXIS)
        canvas.text(left - 6 - text_width(label), ty - 3, label)

    group_w = plot_w / n
    pad = group_w * 0.15
    bar_w = (group_w - 2 * pad) / k
    base = y_of(ticks[0]) if log_y else y_of(0.0)
    for j, vals in enumerate(values.values()):
        for i, value in enumerate(vals):
            if math.isnan(value) or (log_y and value <= 0):
                continue
            x0 = round(left + i * group_w + pad + j * bar_w)
            x1 = max(x0 + 1, round(left + i * group_w + pad + (j + 1) * bar_w) - (1 if bar_w >= 5 else 0))
            y_top, y_bottom = sorted((y_of(value), base))
            y_top, y_bottom = round(y_top), round(y_bottom)
            if y_top == y_bottom and math.isfinite(value) and value != 0:
                y_top -= 1  # tiny but nonzero: keep a visible sliver
            canvas.rect(x0, y_top, x1, y_bottom, PALETTE[j % len(PALETTE)])

    canvas.rect(left - 1, top, left, bottom + 1, AXIS)
    canvas.rect(left - 1, bottom, right, bottom + 1, AXIS)
    if not log_y and ticks[0] < 0:
        canvas.rect(left, round(base), right, round(base) + 1, AXIS)

    label_stride = max(1, math.ceil((wanted * GLYPH_ADVANCE + 6) / group_w))
    max_chars = max(1, int((group_w * label_stride - 6) // GLYPH_ADVANCE))
    for i in range(0, n, label_stride):
        label = clip_text(categories[i], max_chars)
        center = round(left + (i + 0.5) * group_w)
        canvas.rect(center, bottom + 1, center + 1, bottom + 4, AXIS)
        canvas.text(center - text_width(label) // 2, bottom + 7, label)

    write_atomic(path, canvas.png_bytes())
    logger.debug("wrote %s (%dx%d, %d categories x %d series)", path, width, HEIGHT, n, k)
