"""modelopt_ext.testing.checkpoints: stand-ins generated once per (seed, sizes, fit steps) and reused, copies
that get their own remote-code module, and finding a checkpoint's loaded remote-code module."""

import re
import sys
import types

import pytest

from modelopt_ext.testing import checkpoints
from modelopt_ext.testing.checkpoints import copy_checkpoint, remote_module, tiny_checkpoint


@pytest.fixture
def generated(monkeypatch):
    """Calls of the generator, which here only writes a config.json."""
    calls = []

    def make_tiny(out, seed, sizes, force, fit_steps):
        calls.append({"out": out, "seed": seed, "sizes": sizes, "force": force, "fit_steps": fit_steps})
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(checkpoints, "_generator", lambda family: calls.append(family) or make_tiny)
    return calls


def test_generated_once_then_reused(tmp_path, generated):
    path = tiny_checkpoint("kimi_k3", tmp_path)
    assert re.fullmatch(r"kimi_k3-seed0-[0-9a-f]{10}", path.name) and path.parent == tmp_path
    assert generated == ["kimi_k3", {"out": path, "seed": 0, "sizes": {}, "force": True, "fit_steps": 0}]
    assert tiny_checkpoint("kimi_k3", tmp_path) == path and len(generated) == 2  # not generated again


def test_each_family_seed_size_and_fit_gets_its_own_checkpoint(tmp_path, generated):
    paths = [tiny_checkpoint("kimi_k3", tmp_path), tiny_checkpoint("kimi_k3", tmp_path, seed=1),
             tiny_checkpoint("kimi_k3", tmp_path, sizes={"num_experts": 8}),
             tiny_checkpoint("kimi_k3", tmp_path, sizes={"latent_size": 32}),
             tiny_checkpoint("kimi_k3", tmp_path, fit_steps=20), tiny_checkpoint("deepseek_v3", tmp_path)]
    assert len(set(paths)) == 6 and len(generated) == 12
    assert paths[1].name.startswith("kimi_k3-seed1-") and paths[4].name == paths[0].name + "-fit20"
    assert paths[5].name.startswith("deepseek_v3-seed0-")
    assert generated[9]["fit_steps"] == 20 and generated[5]["sizes"] == {"num_experts": 8}


def test_an_unfinished_checkpoint_is_generated_again(tmp_path, generated):
    path = tiny_checkpoint("kimi_k3", tmp_path)
    (path / "config.json").unlink()  # a generation that stopped before its config was written
    assert tiny_checkpoint("kimi_k3", tmp_path) == path and len(generated) == 4


def test_the_session_checkpoint_is_a_real_stand_in(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(checkpoints, "_generator", lambda family: pytest.fail("regenerated an existing checkpoint"))
    assert tiny_checkpoint("kimi_k3", tiny_ckpt.parent) == tiny_ckpt
    for name in ("config.json", "model.safetensors.index.json", "configuration_kimi_k3.py", "tokenizer.json"):
        assert (tiny_ckpt / name).is_file(), name


def test_a_family_without_a_generator_is_refused():
    import dataclasses

    from modelopt_ext.families import families

    spec = dataclasses.replace(families()["kimi_k3"], make_tiny=None)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("modelopt_ext.families.families", lambda: {"kimi_k3": spec})
        with pytest.raises(ValueError, match="family 'kimi_k3' has no stand-in generator"):
            checkpoints._generator("kimi_k3")


def test_copy_checkpoint_copies_every_file_and_refuses_an_existing_name(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "w.bin").write_bytes(b"\x00\x01\x02")
    dst = copy_checkpoint(src, tmp_path / "copies", "one")
    assert dst == tmp_path / "copies" / "one"
    assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*")) == ["config.json", "sub", "sub/w.bin"]
    assert (dst / "sub" / "w.bin").read_bytes() == b"\x00\x01\x02"
    with pytest.raises(FileExistsError, match=f"{dst} exists; use a fresh name"):
        copy_checkpoint(src, tmp_path / "copies", "one")


def test_remote_module_matches_the_folder_name_and_the_file(monkeypatch, tmp_path):
    assert remote_module(tmp_path / "never_loaded", "modeling_kimi_k3") is None
    mine = types.ModuleType("transformers_modules.ckpt_a.0123abcd.modeling_kimi_k3")
    other = types.ModuleType("transformers_modules.ckpt_ab.0123abcd.modeling_kimi_k3")
    monkeypatch.setitem(sys.modules, mine.__name__, mine)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert remote_module(tmp_path / "ckpt_a", "modeling_kimi_k3") is mine
    assert remote_module(tmp_path / "ckpt_ab", "modeling_kimi_k3") is other  # not a prefix match
    assert remote_module(tmp_path / "ckpt_a", "configuration_kimi_k3") is None


def test_a_copy_loads_its_own_remote_code_module(tiny_ckpt, tmp_path):
    from transformers import AutoConfig

    a, b = copy_checkpoint(tiny_ckpt, tmp_path, "remote_a"), copy_checkpoint(tiny_ckpt, tmp_path, "remote_b")
    config_a = AutoConfig.from_pretrained(a, trust_remote_code=True)
    assert remote_module(b, "configuration_kimi_k3") is None  # b not loaded yet
    config_b = AutoConfig.from_pretrained(b, trust_remote_code=True)
    module_a, module_b = remote_module(a, "configuration_kimi_k3"), remote_module(b, "configuration_kimi_k3")
    assert module_a is not None and module_b is not None and module_a is not module_b
    assert type(config_a).__module__ == module_a.__name__ and type(config_b).__module__ == module_b.__name__
