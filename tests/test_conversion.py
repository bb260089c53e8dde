"""modelopt_ext/conversion.py: a conversion mapping registered with transformers for one load only (Kimi-K3's
converters serve as the sample transforms)."""

from __future__ import annotations

import pytest
import transformers.conversion_mapping as cm

from modelopt_ext.conversion import scoped_conversion_mapping
from modelopt_ext.models.kimi_k3.convert import expert_converters


def _registry_snapshot():
    if cm._checkpoint_conversion_mapping_cache is None:
        cm.get_checkpoint_conversion_mapping("llama")
    reg = cm._checkpoint_conversion_mapping_cache
    return reg, dict(reg), set(cm.USER_REGISTERED_MAPPINGS)


def _assert_restored(snap):
    reg, items, user = snap
    assert cm._checkpoint_conversion_mapping_cache is reg
    assert reg.keys() == items.keys()
    assert all(reg[k] is items[k] for k in items)
    assert cm.USER_REGISTERED_MAPPINGS == user


@pytest.mark.parametrize("raises", [False, True], ids=["ok", "body-raises"])
def test_scoped_conversion_mapping_new_name(raises):
    snap = _registry_snapshot()
    native_kimi = cm._checkpoint_conversion_mapping_cache.get("kimi_linear")
    assert native_kimi is not None
    name = "ScopedMappingTestModelA"
    transforms = expert_converters("mxfp4")
    assert name not in snap[1]

    def body():
        with scoped_conversion_mapping(name, transforms):
            assert cm._checkpoint_conversion_mapping_cache[name] is transforms
            assert name in cm.USER_REGISTERED_MAPPINGS
            assert cm._checkpoint_conversion_mapping_cache["kimi_linear"] is native_kimi
            if raises:
                raise KeyError("inside")

    if raises:
        with pytest.raises(KeyError, match="inside"):
            body()
    else:
        body()
    _assert_restored(snap)
    assert cm._checkpoint_conversion_mapping_cache["kimi_linear"] is native_kimi
    assert "kimi_linear" not in cm.USER_REGISTERED_MAPPINGS or "kimi_linear" in snap[2]


def test_scoped_conversion_mapping_restores_existing_entries():
    # a native entry: replaced inside, back afterwards, and not left marked as user-registered
    snap = _registry_snapshot()
    native = cm._checkpoint_conversion_mapping_cache["mixtral"]
    with pytest.raises(RuntimeError):
        with scoped_conversion_mapping("mixtral", expert_converters("dense")):
            assert cm._checkpoint_conversion_mapping_cache["mixtral"] is not native
            assert "mixtral" in cm.USER_REGISTERED_MAPPINGS
            raise RuntimeError
    _assert_restored(snap)

    # a user's own earlier registration: restored and still marked as the user's
    name = "ScopedMappingTestModelB"
    mine = expert_converters("dense")
    cm.register_checkpoint_conversion_mapping(name, mine)
    try:
        snap = _registry_snapshot()
        with scoped_conversion_mapping(name, expert_converters("mxfp4")):
            assert cm._checkpoint_conversion_mapping_cache[name] is not mine
        _assert_restored(snap)
        assert cm._checkpoint_conversion_mapping_cache[name] is mine and name in cm.USER_REGISTERED_MAPPINGS
    finally:
        cm._checkpoint_conversion_mapping_cache.pop(name, None)
        cm.USER_REGISTERED_MAPPINGS.discard(name)


def test_scoped_conversion_mapping_builds_the_registry(monkeypatch):
    monkeypatch.setattr(cm, "_checkpoint_conversion_mapping_cache", None)
    name = "ScopedMappingTestModelC"
    with scoped_conversion_mapping(name, expert_converters("dense")):
        reg = cm._checkpoint_conversion_mapping_cache
        assert reg is not None and name in reg and "kimi_linear" in reg
    assert name not in cm._checkpoint_conversion_mapping_cache
    assert name not in cm.USER_REGISTERED_MAPPINGS
    assert "kimi_linear" in cm._checkpoint_conversion_mapping_cache
