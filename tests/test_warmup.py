"""`modelopt_ext.warmup.Warmup`: one forward on a thread, bounded waits, failures reported and never raised."""

from __future__ import annotations

import threading

import torch

from modelopt_ext.warmup import Warmup


class _Model(torch.nn.Module):
    def __init__(self, hook=None):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.calls, self.hook = [], hook

    def forward(self, input_ids, use_cache=None):
        self.calls.append((threading.current_thread().name, tuple(input_ids.shape), use_cache, torch.is_grad_enabled()))
        if self.hook is not None:
            self.hook()
        return self.linear(input_ids.float())


def test_runs_one_no_grad_forward_on_its_own_thread():
    model = _Model()
    warm = Warmup(model, torch.zeros(2, 4, dtype=torch.long)).start()
    seconds = warm.wait(30)
    assert seconds is not None and seconds >= 0
    assert model.calls == [("modelopt-ext-warmup", (2, 4), False, False)]
    assert warm.model is None and warm.input_ids is None  # nothing of it is kept once it ended


def test_a_failure_is_logged_not_raised(caplog):
    def boom():
        raise RuntimeError("out of memory (simulated)")

    warm = Warmup(_Model(boom), torch.zeros(1, 4, dtype=torch.long)).start()
    with caplog.at_level("WARNING"):
        assert warm.wait(30) is None
    assert "warm-up forward failed" in caplog.text and "out of memory (simulated)" in caplog.text


def test_the_wait_is_bounded(caplog):
    release = threading.Event()
    warm = Warmup(_Model(lambda: release.wait(30)), torch.zeros(1, 4, dtype=torch.long)).start()
    try:
        with caplog.at_level("WARNING"):
            assert warm.wait(0.2) is None
        assert "still running after" in caplog.text
    finally:
        release.set()
    assert warm.wait(30) is not None  # it finishes once released
