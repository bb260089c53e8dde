"""KimiHybridCache (modelopt_ext.models.kimi_k3.cache) against the stand-in's torch.cat `KimiDynamicCache`."""

import pytest
import torch
from transformers.cache_utils import Cache

from modelopt_ext.models.kimi_k3.cache import MIN_CAPACITY, KimiHybridCache
from modelopt_ext.models.kimi_k3.standin import configuration_kimi_k3 as ck
from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as mkl
from modelopt_ext.models.kimi_k3.standin.configs import tiny_text_config

B, H, DK, DV = 2, 3, 5, 4


_tiny_text_config = tiny_text_config


def _hybrid_config():
    """Five layers: KDA 0, 1, MLA 2, KDA 3, MLA 4."""
    lac = {"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "num_heads": 2, "head_dim": 8,
           "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0}
    return _tiny_text_config(num_hidden_layers=5, linear_attn_config=lac)


def _kv(S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, S, DK, generator=g), torch.randn(B, H, S, DV, generator=g)


def _kda_states(seed, D=16, K=3, heads=2, d=8):
    g = torch.Generator().manual_seed(seed)
    conv = tuple(torch.randn(B, D, K, generator=g) for _ in range(3))
    return conv, torch.randn(B, heads, d, d, generator=g)


def _cached(cache, i):
    layer = cache.layers[i]
    return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]


def _feed_both(config, lengths, **kwargs):
    ours, ref = KimiHybridCache(config, **kwargs), mkl.KimiDynamicCache(config)
    layer = ours.mla_layers[0]
    for step, S in enumerate(lengths):
        k, v = _kv(S, step)
        got_k, got_v = ours.update(k, v, layer)
        want_k, want_v = ref.update(k, v, layer)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"step {step}"
    return ours, ref


def test_is_a_transformers_cache_with_the_remote_code_attributes():
    config = _hybrid_config()
    cache = KimiHybridCache(config)
    assert isinstance(cache, Cache) and not cache.is_compileable
    assert len(cache) == 5 and cache.mla_layers == [2, 4]
    assert cache.is_linear == [True, True, False, True, False]
    assert all(cache.conv_states[i] is None and cache.recurrent_states[i] is None for i in range(5))
    # the multimodal config is accepted through get_text_config()
    k3 = ck.KimiK3Config(text_config=config)
    assert KimiHybridCache.from_model_config(k3).mla_layers == [2, 4]


def test_update_matches_upstream_torch_cat_cache():
    ours, _ = _feed_both(_tiny_text_config(), [7, 1, 1, 1, 3, 1])
    assert ours.get_seq_length() == 14


def test_growth_past_initial_capacity_keeps_contents():
    ours, ref = _feed_both(_tiny_text_config(), [MIN_CAPACITY - 2] + [1] * 5)
    layer = ours.layers[ours.mla_layers[0]]
    assert layer.capacity == 2 * MIN_CAPACITY and ours.get_seq_length() == MIN_CAPACITY + 3
    # a long prefill gets the next power of two at once
    big, _ = _feed_both(_tiny_text_config(), [3 * MIN_CAPACITY, 1])
    assert big.layers[big.mla_layers[0]].capacity == 4 * MIN_CAPACITY


def test_fixed_max_cache_len_allocates_once_and_refuses_overflow():
    ours, _ = _feed_both(_tiny_text_config(), [5, 1, 1, 1], max_cache_len=9)
    layer = ours.layers[ours.mla_layers[0]]
    assert layer.capacity == 9 and ours.get_max_length() == 9
    with pytest.raises(ValueError, match=r"10 tokens.*max_cache_len=9"):
        ours.update(*_kv(2, 99), ours.mla_layers[0])
    with pytest.raises(ValueError, match=r"12 tokens.*max_cache_len=11"):
        KimiHybridCache(_tiny_text_config(), max_cache_len=11).update(*_kv(12, 0), 2)


def test_steps_that_fit_reuse_storage():
    cache = KimiHybridCache(_tiny_text_config())
    cache.update(*_kv(6, 0), 2)
    layer = cache.layers[2]
    ptr_k, ptr_v = layer.keys.data_ptr(), layer.values.data_ptr()
    for step in range(3):
        k, _ = cache.update(*_kv(1, step + 1), 2)
        assert k.data_ptr() == ptr_k  # the returned view starts at the buffer
    assert layer.keys.data_ptr() == ptr_k and layer.values.data_ptr() == ptr_v
    # the KDA states are copied into storage allocated once
    conv, rec = _kda_states(0)
    cache.conv_states[0], cache.recurrent_states[0] = conv, rec
    ptrs = [t.data_ptr() for t in cache.conv_states[0]] + [cache.recurrent_states[0].data_ptr()]
    conv2, rec2 = _kda_states(1)
    cache.conv_states[0], cache.recurrent_states[0] = conv2, rec2
    assert [t.data_ptr() for t in cache.conv_states[0]] + [cache.recurrent_states[0].data_ptr()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(cache.conv_states[0], conv2))
    assert torch.equal(cache.recurrent_states[0], rec2)


def test_lengths_and_mask_sizes_by_hand():
    cache = KimiHybridCache(_hybrid_config())
    for i in (0, 1, 2, 3, 4):
        assert cache.get_seq_length(i) == 0 and cache.get_mask_sizes(3, i) == (3, 0)
    cache.update(*_kv(4, 0), 2)
    cache.update(*_kv(4, 1), 4)
    cache.update(*_kv(1, 2), 2)  # layer 2 is one token ahead of layer 4, as inside a decoder forward
    assert cache.get_seq_length(2) == 5 and cache.get_seq_length(4) == 4
    for kda in (0, 1, 3):  # KDA layers answer with the first MLA layer
        assert cache.get_seq_length(kda) == 5
        assert cache.get_mask_sizes(1, kda) == (6, 0)
        assert cache.get_query_offset(kda) == 5
    assert cache.get_seq_length() == 5 and cache.get_seq_length(None) == 5
    assert cache.get_mask_sizes(3, 4) == (7, 0) and cache.get_query_offset(4) == 4
    assert cache.get_mask_sizes(torch.arange(2), 2) == (7, 0)  # the old cache_position form
    assert cache.get_max_length() == -1
    with pytest.raises(ValueError, match="KDA layer"):
        cache.update(*_kv(1, 0), 1)


def test_has_previous_state_reorder_and_reset():
    cache = KimiHybridCache(_hybrid_config())
    assert not cache.has_previous_state() and not cache.has_previous_state(0)
    conv, rec = _kda_states(0)
    cache.conv_states[3], cache.recurrent_states[3] = conv, rec
    assert cache.has_previous_state() and cache.has_previous_state(3) and not cache.has_previous_state(0)
    k, v = _kv(5, 1)
    cache.update(k, v, 2)
    beam_idx = torch.tensor([1, 0])
    cache.reorder_cache(beam_idx)
    got_k, got_v = _cached(cache, 2)
    assert torch.equal(got_k, k[beam_idx]) and torch.equal(got_v, v[beam_idx])
    assert all(torch.equal(a, b[beam_idx]) for a, b in zip(cache.conv_states[3], conv))
    assert torch.equal(cache.recurrent_states[3], rec[beam_idx])
    cache.batch_repeat_interleave(2)
    assert _cached(cache, 2)[0].shape[0] == 4 and cache.recurrent_states[3].shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert torch.equal(_cached(cache, 2)[0], k[[1, 0]])
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.has_previous_state()
    assert cache.conv_states[3] is None and cache.recurrent_states[3] is None
    new_k, _ = cache.update(*_kv(2, 5), 2)
    assert new_k.shape[2] == 2 and torch.equal(new_k, _kv(2, 5)[0])


def test_crop():
    cache = KimiHybridCache(_hybrid_config())
    cache.update(*_kv(6, 0), 2)
    cache.crop(0)
    assert cache.get_seq_length() == 6
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    cache.crop(3)  # legacy: keep at most 3
    assert torch.equal(_cached(cache, 2)[0], _kv(6, 0)[0][:, :, :3])
    cache.recurrent_states[0] = _kda_states(0)[1]
    with pytest.raises(RuntimeError, match="rolled back"):
        cache.crop(-1)


def _random_model(config):
    torch.manual_seed(0)
    model = mkl.KimiLinearForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


def _decode(model, ids, cache, prompt_len):
    with torch.no_grad():
        logits = [model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True).logits]
        for pos in range(prompt_len, ids.shape[1]):
            logits.append(model(input_ids=ids[:, pos : pos + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


def test_model_decode_matches_upstream_cache_and_full_forward():
    config = _tiny_text_config()
    model = _random_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    ours = _decode(model, ids, KimiHybridCache(config), prompt_len=7)
    upstream = _decode(model, ids, mkl.KimiDynamicCache(config), prompt_len=7)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
    assert ours.shape == full.shape == (2, 10, config.vocab_size) and full.std() > 0.1
    torch.testing.assert_close(ours, upstream, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=0)
