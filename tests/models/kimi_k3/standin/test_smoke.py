"""models/kimi_k3/standin/smoke.py: plain transformers on a Kimi-K3 checkpoint (the `forward` command's body;
the forwards themselves: tests/test_cli.py)."""

from __future__ import annotations

import json

import pytest

from modelopt_ext.models.kimi_k3.standin.smoke import run_forwards, unquantized_modules


def test_unquantized_modules_are_the_plain_weights_the_ignore_list_misses(tmp_path):
    keys = ["a.q_proj.weight", "a.experts.0.w1.weight_packed", "a.routed_expert_up_proj.weight",
            "a.mlp_res_proj.weight", "lm_head.weight", "vision_tower.x.weight", "a.norm.bias"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(keys, "m")}))
    ignore = ["lm_head.weight", "re:vision_tower.*", "re:.*q_proj$"]
    assert unquantized_modules(str(tmp_path), ignore) == ["a.mlp_res_proj", "a.routed_expert_up_proj"]


def test_run_forwards_refuses_remote_code_that_differs_from_the_lock(tiny_ckpt, tmp_path, monkeypatch):
    import transformers

    from modelopt_ext.testing.checkpoints import copy_checkpoint

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path, "smoke_tampered")
    with (ckpt / "configuration_kimi_k3.py").open("a") as f:
        f.write("\nraise SystemExit('tampered code ran')\n")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("code loaded"))
    with pytest.raises(ValueError, match="configuration_kimi_k3.py"):
        run_forwards(str(ckpt))
