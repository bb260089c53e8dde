"""The grouped calibration path of the experts (CUDA by default; forced on CPU here) gives ModelOpt the same
input statistics as its per-expert eager path, and the same layer outputs within rounding."""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_ext
from modelopt_ext.experts.fused import FusedExperts
from modelopt_ext.options import ExpertsOptions, set_experts_options
from modelopt_ext.testing.checkpoints import copy_checkpoint


def _calibrate(model, mode, monkeypatch):
    import modelopt.torch.quantization as mtq

    from modelopt_ext.quant.recipes import quant_config

    set_experts_options(model, ExpertsOptions(grouped_statistics=mode))
    calls = []
    original = FusedExperts._grouped_statistics_forward

    def counting(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(FusedExperts, "_grouped_statistics_forward", counting)
    ids = torch.randint(13, 500, (2, 24), generator=torch.Generator().manual_seed(5))
    cfg = quant_config("kimi_k3/nvfp4_experts-fp8_attention", model.config)
    with torch.no_grad():
        model = mtq.quantize(model, cfg, lambda m: m(input_ids=ids, use_cache=False))
    amax = {n: q.amax.clone() for n, q in model.named_modules()
            if type(q).__name__ == "TensorQuantizer" and "experts." in n and "input_quantizer" in n
            and q.amax is not None}
    return amax, len(calls)


def test_grouped_statistics_equal_the_eager_per_expert_ones(tiny_ckpt, tmp_path, monkeypatch):
    src = copy_checkpoint(tiny_ckpt, tmp_path, "grouped_stats")
    base = modelopt_ext.from_pretrained(src, trust_remote_code=True, dtype=torch.float32)
    eager, n_eager = _calibrate(copy.deepcopy(base), "never", monkeypatch)
    grouped, n_grouped = _calibrate(copy.deepcopy(base), "always", monkeypatch)
    assert n_eager == 0 and n_grouped == 5  # one grouped forward per MoE layer
    assert sorted(eager) == sorted(grouped) and len(eager) == 10  # gate_up and down inputs of 5 layers
    for name in eager:
        if "layers.1." in name and "gate_up_proj" in name:  # the first MoE layer's rows: the same numbers
            assert torch.equal(eager[name], grouped[name]), name
        # after a GEMM (and in later layers): grouped vs per-expert GEMMs round differently on CPU
        torch.testing.assert_close(grouped[name], eager[name], rtol=1e-5, atol=0, msg=name)


def test_quantizing_forward_takes_the_eager_path(monkeypatch):
    """Once quantizers quantize (after calibration), the per-expert path runs: each expert's weights are
    fake-quantized with its own quantizer, which the grouped path does not do."""
    from types import SimpleNamespace

    module = FusedExperts.__new__(FusedExperts)
    torch.nn.Module.__init__(module)
    collect = SimpleNamespace(is_enabled=True, _if_quant=False)
    quant = SimpleNamespace(is_enabled=True, _if_quant=True)
    module.__dict__.update(gate_up_proj_input_quantizer=collect, down_proj_input_quantizer=collect,
                           gate_up_proj_weight_quantizers=[collect], down_proj_weight_quantizers=[collect])
    assert module._collecting_statistics()
    module.__dict__["down_proj_weight_quantizers"] = [quant]
    assert not module._collecting_statistics()
    module.__dict__["down_proj_weight_quantizers"] = [SimpleNamespace(is_enabled=False, _if_quant=True)]
    assert module._collecting_statistics()
    del module.__dict__["down_proj_input_quantizer"]
    assert not module._collecting_statistics()  # not converted by ModelOpt


pytest.importorskip("modelopt")
