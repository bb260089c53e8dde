"""Refuse, before anything is loaded, a recipe that quantizes the KV cache where no serving engine can use it.

ModelOpt quantizes the KV cache with two quantizers on each attention module, `k_bmm_quantizer` and
`v_bmm_quantizer` (its own units spell them `*[kv]_bmm_quantizer`), and its export writes their amax / 448 as
`self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` and sets `kv_cache_quant_algo`. Whether that is of use
depends on the engines: the family's `ServingSpec.kv_cache` (`families.KVCacheServing`) says, per engine, whether
it loads such calibrated scales for the cache it keeps (None) or what it does instead. When the recipe enables
either quantizer on any of the family's attention modules and an engine described there cannot use the scales,
`check_kv_cache` raises ValueError naming the recipe entry that enabled it, what the engines do, and the
alternative. A family without `kv_cache` facts is not checked.

The quantizers' states are worked out from the `quant_cfg` list alone, by ModelOpt's rules
(`set_quantizer_by_cfg`, 0.47): entries apply in order to every quantizer whose name matches `quantizer_name`
(fnmatch); an entry with `cfg` sets the quantizer up and enables it unless `enable: false`; one without `cfg`
only switches it; a quantizer no entry matches keeps ModelOpt's default, enabled. An entry restricted by
`parent_class` applies when that class name ends in `Attention`: ModelOpt attaches KV quantizers only to
modules whose class name does (`register_hf_attentions_on_the_fly`), and the class itself is not known before
loading.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

KV_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer")


def _entries(quant_cfg: list) -> list[tuple[int, str, bool]]:
    """(index in quant_cfg, pattern, enabled after it) for the entries that name a quantizer."""
    out = []
    for i, entry in enumerate(quant_cfg):
        pattern = entry.get("quantizer_name") if isinstance(entry, Mapping) else None
        parent = entry.get("parent_class") if isinstance(entry, Mapping) else None
        if isinstance(pattern, str) and (not parent or str(parent).rpartition(".")[2].endswith("Attention")):
            out.append((i, pattern, bool(entry.get("enable", True))))
    return out


def enabled_kv_quantizers(quant_cfg: list, modules: Sequence[str]) -> dict[str, int | None]:
    """KV quantizer name (`{module}.k_bmm_quantizer`, ...) -> index of the quant_cfg entry that leaves it
    enabled (None: no entry matches it, so ModelOpt's default keeps it enabled), for the enabled ones only."""
    entries = _entries(quant_cfg)
    enabled = {}
    for module in modules:
        for leaf in KV_QUANTIZERS:
            name = f"{module}.{leaf}"
            state, source = True, None
            for i, pattern, enable in entries:
                if fnmatch.fnmatch(name, pattern):
                    state, source = enable, i
            if state:
                enabled[name] = source
    return enabled


def check_kv_cache(quant_cfg: list, config: Mapping[str, Any], serving, recipe: str,
                   sources: Sequence[Any] = ()) -> None:
    """Raise ValueError when `quant_cfg` (the recipe with the family's exclusions) enables a KV-cache
    quantizer that an engine of `serving.kv_cache` cannot use. `sources[i]` names entry i (EntrySource)."""
    facts = getattr(serving, "kv_cache", None)
    if facts is None:
        return
    refusing = {engine: what for engine, what in facts.engines.items() if what is not None}
    if not refusing:
        return
    enabled = enabled_kv_quantizers(quant_cfg, facts.attention_modules(config))
    if not enabled:
        return
    by_entry: dict[int | None, list[str]] = {}
    for name, index in enabled.items():
        by_entry.setdefault(index, []).append(name)
    parts = []
    for index, names in by_entry.items():
        if index is None:
            where = "no entry disables them and ModelOpt enables a quantizer by default"
        else:
            source = sources[index] if index < len(sources) else f"quantize.quant_cfg[{index}]"
            where = f"{source} (quantizer_name {quant_cfg[index]['quantizer_name']!r})"
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        parts.append(f"{where} enables {names[0]}{more}")
    engines = "; ".join(f"{engine}: {what}" for engine, what in refusing.items())
    raise ValueError(
        f"recipe {recipe} quantizes the KV cache, whose calibrated scales {', '.join(refusing)} cannot use: "
        + "; ".join(parts)
        + f". The engines cache {facts.cached}. {engines}. {facts.measured}. Instead: {facts.alternative}")
