"""modelopt_ext.progress: progress bars driven by library hooks, and the figures summaries show."""

import re

from modelopt_ext.progress import ProgressBar, format_bytes, peak_device_bytes, peak_host_bytes


def test_bar_moves_to_absolute_counts(capsys):
    with ProgressBar("calibrate", total=4, unit="batch") as bar:
        for done in (1, 2, 4):
            bar(done)
        assert bar._bar.n == 4
    err = capsys.readouterr().err
    assert "calibrate" in err and "4/4" in err


def test_bar_without_total_starts_when_the_total_is_known(capsys):
    bar = ProgressBar("export", unit="unit")
    assert bar._bar is None and capsys.readouterr().err == ""
    bar(1, 3)
    bar(3, 3)
    bar.close()
    err = capsys.readouterr().err
    assert "3/3" in err
    # a bar without a total would print "export: 0unit [00:00, ?unit/s]"; the rate ("...60unit/s") may end in 0
    assert not re.search(r"export: \d+unit \[", err), err


def test_disabled_bar_writes_nothing(capsys):
    with ProgressBar("calibrate", total=2, enabled=False) as bar:
        bar(1)
        bar(2, 2)
        assert (bar.done, bar.total, bar._bar) == (2, 2, None)
    assert capsys.readouterr().err == ""


def test_format_bytes():
    sizes = (0, 512, 1536, 5 * 2**20, 3 * 2**30 + 2**29)
    assert [format_bytes(n) for n in sizes] == ["0 B", "512 B", "1.5 KiB", "5.0 MiB", "3.5 GiB"]


def test_peak_memory():
    assert peak_host_bytes() > 2**20  # a Python process with torch holds more than a MiB
    assert peak_device_bytes() is None or peak_device_bytes() >= 0
