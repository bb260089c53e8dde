"""Tests for the dependency-free PNG bar chart writer: PNG validity, bar placement, determinism, edge values."""

import math
import struct
import zlib

import pytest

from modelopt_ext.report.png import PALETTE, format_number, grouped_bars_png


def decode_png(path):
    """Parse an 8-bit RGB, non-interlaced PNG written with filter 0: returns (width, height, rows of bytes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color_type, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    stride = 1 + 3 * width
    rows = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def column_runs(width, height, rows, color):
    """Consecutive x runs holding `color` below the top eighth of the image (the bars, not the title and legend
    swatch), each as (first x, last x, pixel count, tallest column)."""
    counts, pixel = [0] * width, bytes(color)
    for row in rows[height // 8:]:
        start = row.find(pixel)
        while start != -1:
            if start % 3 == 0:
                counts[start // 3] += 1
            start = row.find(pixel, start + 1)
    runs, start = [], None
    for x, count in enumerate(counts + [0]):
        if count and start is None:
            start = x
        elif not count and start is not None:
            runs.append((start, x - 1, sum(counts[start:x]), max(counts[start:x])))
            start = None
    return runs


def test_valid_png_with_size(tmp_path):
    path = tmp_path / "chart.png"
    grouped_bars_png(path, title="Error per layer", categories=["L1", "L2", "L3"],
                     series={"ours": [0.01, 0.02, 0.015], "baseline": [0.03, 0.05, 0.04]}, ylabel="rel. MSE")
    width, height, _ = decode_png(path)
    assert 640 <= width <= 2400 and height == 420
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temp file left behind


def test_width_grows_with_categories_and_is_capped(tmp_path):
    widths = []
    for n in (3, 150, 2000):
        path = tmp_path / f"c{n}.png"
        grouped_bars_png(path, title="t", categories=[f"L{i}" for i in range(n)], series={"s": [1.0] * n}, ylabel="y")
        widths.append(decode_png(path)[0])
    assert widths[0] == 640 and widths[0] < widths[1] <= widths[2] == 2400


def test_tallest_bar_has_most_pixels(tmp_path):
    path = tmp_path / "bars.png"
    grouped_bars_png(path, title="t", categories=["a", "b", "c"], series={"ours": [1.0, 5.0, 2.0]}, ylabel="y")
    runs = column_runs(*decode_png(path), PALETTE[0])
    assert len(runs) == 3
    assert runs[1][2] > runs[2][2] > runs[0][2]


def test_series_get_their_own_colours(tmp_path):
    path = tmp_path / "two.png"
    grouped_bars_png(path, title="t", categories=["a", "b"], series={"ours": [1.0, 2.0], "base": [2.0, 1.0]},
                     ylabel="y")
    width, height, rows = decode_png(path)
    ours, base = column_runs(width, height, rows, PALETTE[0]), column_runs(width, height, rows, PALETTE[1])
    assert len(ours) == len(base) == 2
    assert ours[0][0] < base[0][0] < ours[1][0] < base[1][0]  # grouped per category, series side by side


def test_deterministic_bytes(tmp_path):
    kwargs = dict(title="Same", categories=["L1", "L2"], series={"a": [1e-5, 3e-5], "b": [2e-5, 0.0]},
                  ylabel="err", log_y=True)
    grouped_bars_png(tmp_path / "one.png", **kwargs)
    grouped_bars_png(tmp_path / "two.png", **kwargs)
    assert (tmp_path / "one.png").read_bytes() == (tmp_path / "two.png").read_bytes()


@pytest.mark.parametrize("log_y", [False, True])
@pytest.mark.parametrize("values", [
    [0.0, float("nan"), float("inf"), 1.0],
    [float("nan"), float("nan"), float("nan"), float("nan")],
    [0.0, 0.0, 0.0, 0.0],
    [-1.0, float("-inf"), 2.0, 1e-12],
    [float("inf"), float("inf"), 0.0, float("nan")],
])
def test_special_values_do_not_crash(tmp_path, values, log_y):
    path = tmp_path / "special.png"
    grouped_bars_png(path, title="special \u00b5 values", categories=["w", "x", "y", "z"], series={"s": values},
                     ylabel="v", log_y=log_y)
    decode_png(path)


def test_nan_bar_skipped_and_inf_clipped(tmp_path):
    path = tmp_path / "clip.png"
    grouped_bars_png(path, title="t", categories=["a", "b", "c", "d"],
                     series={"s": [0.5, float("nan"), float("inf"), 1.0]}, ylabel="y")
    runs = column_runs(*decode_png(path), PALETTE[0])
    assert len(runs) == 3  # no bar for NaN
    assert runs[1][3] == runs[2][3] > runs[0][3]  # inf clipped to the axis top, as tall as the maximum


def test_log_scale_skips_zero(tmp_path):
    path = tmp_path / "log.png"
    grouped_bars_png(path, title="t", categories=["a", "b", "c"], series={"s": [1e-5, 0.0, 1e-2]}, ylabel="y",
                     log_y=True)
    runs = column_runs(*decode_png(path), PALETTE[0])
    assert len(runs) == 2 and runs[1][2] > runs[0][2]


def test_long_labels_and_many_series(tmp_path):
    path = tmp_path / "long.png"
    categories = [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(40)]
    series = {f"series number {j}": [math.sin(i + j) + 1.5 for i in range(40)] for j in range(12)}
    grouped_bars_png(path, title="x" * 500, categories=categories, series=series, ylabel="y" * 500)
    assert decode_png(path)[0] == 2400


def test_length_mismatch_names_series(tmp_path):
    with pytest.raises(ValueError, match="'baseline'"):
        grouped_bars_png(tmp_path / "bad.png", title="t", categories=["a", "b"],
                         series={"ours": [1.0, 2.0], "baseline": [1.0]}, ylabel="y")
    assert not list(tmp_path.iterdir())


def test_empty_inputs_rejected(tmp_path):
    with pytest.raises(ValueError):
        grouped_bars_png(tmp_path / "e.png", title="t", categories=[], series={"s": []}, ylabel="y")
    with pytest.raises(ValueError):
        grouped_bars_png(tmp_path / "e.png", title="t", categories=["a"], series={}, ylabel="y")


def test_format_number_is_compact():
    assert format_number(0.0) == "0"
    assert format_number(0.012) == "0.012"
    assert format_number(1.2e-05) == "1.2e-05"
    assert format_number(0.1 * 3) == "0.3"
    assert format_number(2500.0) == "2500"
