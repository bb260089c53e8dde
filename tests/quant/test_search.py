"""Tests of modelopt_ext/quant/search.py: splitting a weight search off ModelOpt's max calibration."""

from __future__ import annotations

from modelopt_ext.quant.search import split_algorithm


def test_a_plain_algorithm_passes_through():
    algorithm = {"method": "max", "distributed_sync": True}
    base, search = split_algorithm(algorithm)
    assert base == algorithm and base is not algorithm and search is None


def test_a_search_becomes_max_then_the_validated_search():
    base, search = split_algorithm({"method": "mse", "step_size": 0.2, "moe_calib_experts_ratio": 0.5})
    assert base == {"method": "max", "distributed_sync": False, "moe_calib_experts_ratio": 0.5}
    assert (search.method, search.step_size) == ("mse", 0.2)
    base, search = split_algorithm({"method": "local_hessian"})
    assert base == {"method": "max", "distributed_sync": False}
    assert search.method == "local_hessian" and search.block_size > 0
