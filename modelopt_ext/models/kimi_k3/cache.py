"""`KimiHybridCache`: a transformers `Cache` for Kimi-K3's hybrid KDA + MLA text model.

Drop-in for the remote code's `KimiDynamicCache`. Shapes: B batch, h heads, S new tokens, N cached tokens,
C capacity, Dk/Dv key/value head dims, D conv channels, K conv kernel, H KDA heads, V/Kd KDA value/key dims.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, LinearAttentionLayer

logger = logging.getLogger(__name__)

MIN_CAPACITY = 256
NUM_CONV_STATES = 3  # the q, k and v short convolutions of a KDA layer


class KimiMLALayer(DynamicLayer):
    """MLA keys/values in preallocated buffers `keys` [B, h, C, Dk] and `values` [B, h, C, Dv].

    New tokens are written with slice assignment at [length, length + S); `update` returns views [:, :, :N].
    Capacity: `max_cache_len` when given (exceeding it raises), else the next power of two of the needed length
    (at least `MIN_CAPACITY`). Only a write that does not fit reallocates and copies the N cached tokens; as the
    capacity at least doubles each time, the copying costs amortised O(1) per token.
    """

    def __init__(self, layer_idx: int, max_cache_len: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.max_cache_len = max_cache_len
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def _capacity_for(self, needed: int) -> int:
        if self.max_cache_len is not None:
            if needed > self.max_cache_len:
                raise ValueError(
                    f"KimiHybridCache layer {self.layer_idx}: {needed} tokens ({self.length} cached + "
                    f"{needed - self.length} new) exceed max_cache_len={self.max_cache_len}"
                )
            return self.max_cache_len
        return max(MIN_CAPACITY, 1 << max(needed - 1, 0).bit_length())

    def _allocate(self, batch: int, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int) -> None:
        h = key_like.shape[1]
        old_k, old_v, n = self.keys, self.values, self.length
        self.keys = key_like.new_empty(batch, h, capacity, key_like.shape[-1])
        self.values = value_like.new_empty(batch, h, capacity, value_like.shape[-1])
        if n:
            self.keys[:, :, :n] = old_k[:, :, :n]
            self.values[:, :, :n] = old_v[:, :, :n]
        self.device, self.batch_size, self.is_initialized = key_like.device, batch, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.length = 0
        capacity = self._capacity_for(key_states.shape[-2])
        self._allocate(key_states.shape[0], key_states, value_states, capacity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [B, h, S, Dk], value_states [B, h, S, Dv] -> views (keys [B, h, N, Dk], values [B, h, N, Dv])."""
        if not self.is_initialized or (
            self.length == 0
            and (self.keys.shape[:2] != key_states.shape[:2] or self.keys.shape[-1] != key_states.shape[-1]
                 or self.values.shape[-1] != value_states.shape[-1] or self.keys.dtype != key_states.dtype
                 or self.keys.device != key_states.device)
        ):
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            new_capacity = self._capacity_for(end)
            logger.debug("KimiHybridCache layer %d: capacity %d -> %d", self.layer_idx, self.capacity, new_capacity)
            self._allocate(self.keys.shape[0], self.keys, self.values, new_capacity)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        """Forget the cached tokens; the buffers are kept for reuse."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim map (select/permute/repeat) to the cached tokens, in place when B is unchanged."""
        if not self.is_initialized or self.length == 0:
            return
        n = self.length
        k, v = fn(self.keys[:, :, :n]), fn(self.values[:, :, :n])
        if k.shape[0] != self.keys.shape[0]:
            self.length = 0
            self._allocate(k.shape[0], k, v, self.capacity)
        self.keys[:, :, :n], self.values[:, :, :n] = k, v
        self.length = n


class _KDAStateView:
    """`cache.conv_states` / `cache.recurrent_states`: list-like per-layer access to the KDA states.

    conv: a tuple of NUM_CONV_STATES tensors [B, D, K-1] (state_idx 0, 1, 2 of the layer) or None.
    recurrent: a fp32 tensor [B, H, V, Kd] (state_idx 0) or None. MLA indices read as None.
    Assigned tensors are copied into the layer's own storage (allocated once per shape); None clears the layer.
    """

    def __init__(self, cache: KimiHybridCache, kind: str):
        self._cache, self._kind = cache, kind

    def __len__(self) -> int:
        return len(self._cache.layers)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, layer_idx: int):
        layer = self._cache.layers[layer_idx]
        if not isinstance(layer, LinearAttentionLayer):
            return None
        if self._kind == "conv":
            present = all(layer.is_conv_states_initialized[j] and layer.has_previous_state[j]
                          for j in range(layer.number_of_states))
            return tuple(layer.conv_states[j] for j in range(layer.number_of_states)) if present else None
        present = layer.is_recurrent_states_initialized[0] and layer.has_previous_state[0]
        return layer.recurrent_states[0] if present else None

    def __setitem__(self, layer_idx: int, value) -> None:
        layer = self._cache.layers[layer_idx]
        if not isinstance(layer, LinearAttentionLayer):
            if value is None:
                return
            raise ValueError(f"layer {layer_idx} is an MLA layer; it has no KDA {self._kind} state")
        if value is None:
            layer.has_previous_state.update(dict.fromkeys(layer.has_previous_state, False))
            return
        if self._kind == "conv":
            if len(value) != layer.number_of_states:
                raise ValueError(
                    f"expected {layer.number_of_states} conv states for layer {layer_idx}, got {len(value)}"
                )
            for j, tensor in enumerate(value):
                self._store(layer, "conv", j, tensor)
        else:
            self._store(layer, "recurrent", 0, value)

    @staticmethod
    def _store(layer: LinearAttentionLayer, kind: str, j: int, tensor: torch.Tensor) -> None:
        states = layer.conv_states if kind == "conv" else layer.recurrent_states
        ready = layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized
        old = states[j]
        if not ready[j] or old.shape != tensor.shape or old.dtype != tensor.dtype or old.device != tensor.device:
            layer.lazy_initialization(**{f"{kind}_states": tensor, "state_idx": j})
        states[j].copy_(tensor)
        layer.has_previous_state[j] = True


class KimiHybridCache(Cache):
    """Cache for Kimi-Linear: one `KimiMLALayer` per MLA layer, one transformers `LinearAttentionLayer`
    (NUM_CONV_STATES states) per KDA layer, in `self.layers`.

    Attributes the Kimi remote code uses, as on its `KimiDynamicCache`:
      - `update(key_states [B,h,S,Dk], value_states [B,h,S,Dv], layer_idx)` -> (K [B,h,N,Dk], V [B,h,N,Dv]) for an
        MLA layer, N = past + S (views into preallocated storage, see `KimiMLALayer`);
      - `conv_states[i]`: None or a tuple of three (q, k, v) conv states [B, D, K-1], read and assigned;
      - `recurrent_states[i]`: None or the fp32 KDA state [B, H, V, Kd], read and assigned;
      - `mla_layers`: sorted MLA layer indices; `len(cache)`: num_hidden_layers.
    transformers contract: `get_seq_length`, `get_mask_sizes(query_length, layer_idx)` and `get_query_offset`
    answer for KDA indices with the first MLA layer; `has_previous_state`, `get_max_length`, `reorder_cache`,
    `batch_repeat_interleave`, `batch_select_indices`, `reset`, `crop`; `is_compileable` is False.
    """

    is_compileable = False

    def __init__(self, config, max_cache_len: int | None = None):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n = text_config.num_hidden_layers
        self.mla_layers = [i for i in range(n) if not text_config.is_kda_layer(i)]
        self.max_cache_len = max_cache_len
        layers = [
            KimiMLALayer(i, max_cache_len) if i in self.mla_layers else LinearAttentionLayer(NUM_CONV_STATES)
            for i in range(n)
        ]
        super().__init__(layers=layers)
        self.conv_states = _KDAStateView(self, "conv")
        self.recurrent_states = _KDAStateView(self, "recurrent")

    @classmethod
    def from_model_config(cls, config, max_cache_len: int | None = None) -> KimiHybridCache:
        """Build from a KimiLinearConfig or the multimodal KimiK3Config."""
        return cls(config, max_cache_len=max_cache_len)

    def _attention_layer(self, layer_idx: int | None) -> int:
        if layer_idx is not None and isinstance(self.layers[layer_idx], CacheLayerMixin):
            return layer_idx
        if not self.mla_layers:
            raise ValueError("KimiHybridCache has no MLA layer to measure the sequence length on")
        return self.mla_layers[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(self.layers[layer_idx], KimiMLALayer):
            raise ValueError(
                f"layer {layer_idx} is a KDA layer; only MLA layers {self.mla_layers} take key/value updates"
            )
        return super().update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Cached tokens N of MLA layer `layer_idx` (of the first MLA layer for a KDA index or None)."""
        return self.layers[self._attention_layer(layer_idx)].get_seq_length()

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:
        """(kv_length = N + query_length, kv_offset = 0). A 1-D `cache_position` tensor is accepted too."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.layers[self._attention_layer(layer_idx)].get_mask_sizes(query_length)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self.layers:
            if isinstance(layer, KimiMLALayer):
                layer.map_batch(fn)
                continue
            for j in range(layer.number_of_states):
                if layer.is_conv_states_initialized[j]:
                    layer.conv_states[j] = fn(layer.conv_states[j])
                if layer.is_recurrent_states_initialized[j]:
                    layer.recurrent_states[j] = fn(layer.recurrent_states[j])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute/select batch rows of all K/V, conv and recurrent states (beam search)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def crop(self, tokens_to_remove: int) -> None:
        """transformers 5.24 semantics: a negative value removes that many tokens, 0 is a no-op; a positive value is
        the legacy `max_length` to keep. KDA states cannot be rolled back, so a real crop with them present raises."""
        seq = self.get_seq_length() if self.mla_layers else 0
        keep = seq + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, seq)
        remove = seq - max(keep, 0)
        if remove == 0:
            return
        if any(self.conv_states[i] is not None or self.recurrent_states[i] is not None for i in range(len(self))):
            raise RuntimeError("KimiHybridCache cannot crop: KDA conv/recurrent states cannot be rolled back")
        for i in self.mla_layers:
            self.layers[i].crop(-remove)
