"""Model-family registry (modelopt_ext.families): config reading, lookup, registration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import modelopt_ext.models  # noqa: F401  (registers the built-in families before the registry is copied)
from modelopt_ext import families as fam
from modelopt_ext.families import FamilySpec, families, family_for_config, read_config, register_family


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry for tests that register families; the real one is restored after."""
    copy = dict(fam._FAMILIES)
    monkeypatch.setattr(fam, "_FAMILIES", copy)
    return copy


def _spec(name="fake", model_types=("fake_type",), text_model_type=None) -> FamilySpec:
    return FamilySpec(
        name=name, model_types=model_types, text_model_type=text_model_type, revision="0" * 40,
        remote_code_lock=Path("/nonexistent/lock.json"), min_versions={"torch": "2.0"},
        ep_plan={"*.experts": "ep_dispatch_experts"}, quantizer_exclusions=lambda config: (),
        converters=lambda storage: [], prepare=lambda path, **kw: None,
    )


# ----------------------------------------------------------------------------------------------------
# read_config


def test_read_config_ok(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "n": 1}))
    assert read_config(tmp_path) == {"model_type": "x", "n": 1}
    assert read_config(str(tmp_path)) == {"model_type": "x", "n": 1}


def test_read_config_missing_folder(tmp_path):
    path = tmp_path / "no_such_ckpt"
    with pytest.raises(FileNotFoundError) as exc:
        read_config(path)
    assert str(path) in str(exc.value)


def test_read_config_path_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("{}")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_config(path)


def test_read_config_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value)


@pytest.mark.parametrize("content", [b"{bad json", b"\xff\xfe\x00garbage"], ids=["syntax", "not-utf8"])
def test_read_config_invalid_json(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as exc:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value) and "JSON" in str(exc.value)


@pytest.mark.parametrize("content,kind", [("[1, 2]", "list"), ('"text"', "str"), ("3", "int")])
def test_read_config_not_an_object(tmp_path, content, kind):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError) as exc:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value) and kind in str(exc.value)


# ----------------------------------------------------------------------------------------------------
# lookup


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(ValueError) as exc:
        family_for_config({"model_type": "llama"}, source="/ckpt/config.json")
    msg = str(exc.value)
    assert "/ckpt/config.json" in msg and "'llama'" in msg and "kimi_k3" in msg


def test_missing_model_type():
    with pytest.raises(ValueError, match="None"):
        family_for_config({})


@pytest.mark.parametrize("text_config", [{"model_type": "deepseek_v3"}, {}, None])
def test_wrong_text_model_type_named(text_config):
    config = {"model_type": "kimi_k3"}
    if text_config is not None:
        config["text_config"] = text_config
    with pytest.raises(ValueError) as exc:
        family_for_config(config, source="SRC")
    msg = str(exc.value)
    got = repr((text_config or {}).get("model_type"))
    assert "SRC" in msg and f"text_config.model_type is {got}" in msg and "'kimi_linear'" in msg


def test_family_found_and_families_listing():
    from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

    spec = family_for_config(json.loads(BUNDLED_CONFIG.read_text()))
    assert spec.name == "kimi_k3"
    listing = families()
    assert "kimi_k3" in listing and listing["kimi_k3"] is spec


def test_text_model_type_not_checked_when_unset(registry):
    spec = register_family(_spec())
    assert family_for_config({"model_type": "fake_type", "text_config": {"model_type": "anything"}}) is spec


# ----------------------------------------------------------------------------------------------------
# registration


def test_register_same_spec_twice_is_fine(registry):
    spec = _spec()
    assert register_family(spec) is spec
    assert register_family(spec) is spec
    assert registry["fake_type"] is spec
    assert families()["fake"] is spec
    kimi = families()["kimi_k3"]
    assert register_family(kimi) is kimi


def test_register_different_spec_for_taken_type_raises(registry):
    first = register_family(_spec())
    with pytest.raises(ValueError) as exc:
        register_family(_spec(name="other"))  # equal fields, different object
    assert "'fake_type'" in str(exc.value) and "'fake'" in str(exc.value)
    kimi = families()["kimi_k3"]
    with pytest.raises(ValueError, match="kimi_k3"):
        register_family(dataclasses.replace(kimi, name="kimi_clone"))
    # nothing is half-registered: a spec with one free and one taken model type registers neither
    with pytest.raises(ValueError):
        register_family(_spec(name="mixed", model_types=("brand_new", "kimi_k3")))
    assert "brand_new" not in registry
    assert registry["fake_type"] is first and registry["kimi_k3"] is kimi


def test_registry_fixture_left_no_fake_family():
    assert "fake_type" not in fam._FAMILIES and "fake" not in families()


def test_spec_is_frozen_with_readonly_mappings():
    spec = _spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"
    with pytest.raises(TypeError):
        spec.ep_plan["new"] = "x"
    with pytest.raises(TypeError):
        spec.min_versions["torch"] = "1.0"


def test_a_family_without_remote_code_has_no_revision_or_lock(registry):
    spec = register_family(dataclasses.replace(_spec(name="native"), revision=None, remote_code_lock=None))
    assert family_for_config({"model_type": "fake_type"}) is spec
    assert spec.revision is None and spec.remote_code_lock is None


def test_deepseek_v3_is_registered_without_remote_code():
    from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG

    spec = families()["deepseek_v3"]
    for config in (BUNDLED_CONFIG, KIMI_K2_CONFIG):
        assert family_for_config(json.loads(config.read_text())) is spec
    assert spec.revision is None and spec.remote_code_lock is None
    assert fam.experts_module_glob(spec) == "model.layers.*.mlp.experts"
