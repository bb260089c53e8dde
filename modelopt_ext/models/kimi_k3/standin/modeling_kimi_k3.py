# Stand-in remote code for Kimi-K3, written by the modelopt_ext project from the public facts about the
# checkpoint (see docs/standin.md). The image merge keeps upstream's host-side feature lengths and `.item()`.
"""Kimi-K3 multimodal wrapper: MoonViT-style 3D ViT -> temporal pool + 2x2 merge -> mm_projector -> image rows
merged into the text embeddings.

Shapes: N patches (all images, all frames), p patch size, D vision width (`vt_hidden_size`), Q attention width
(`qkv_hidden_size`), A heads, d = Q / A head dim, H text width, B batch. `pixel_values` [N, 3, p, p] holds every
image's patches, frame-major then row-major; `grid_thws` [num_images, 3] int gives each image's (t, h, w) patch
grid. Each `media_placeholder_token_id` in `input_ids` stands for one image and is expanded into that image's
(h/kh)*(w/kw) feature rows (kh x kw = `merge_kernel_size`).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_kimi_k3 import KimiK3Config, KimiK3VisionConfig
from .modeling_kimi_linear import KimiLinearForCausalLM

logger = logging.get_logger(__name__)

# The values of the vision_config switches this stand-in implements (the real checkpoint's, plus the
# LayerNorm variant and the other interpolation mode the real code also accepts).
SUPPORTED = {
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic"),
    "merge_type": ("sd2_tpool",),
    "norm_type": ("rmsnorm", "layernorm"),
    "mlp_type": ("mlp2",),
    "activation_func": ("gelu_pytorch_tanh",),
    "mm_projector_type": ("patchmergerv2",),
    "projector_hidden_act": ("gelu",),
}
ROPE_MAX_GRID = 512  # the real ViT's rotary table covers 512 x 512 patches
ROPE_THETA = 10000.0


def check_vision_config(config: KimiK3Config) -> None:
    """Raise ValueError, naming the key, the value and what is supported, for a vision_config this code cannot run."""
    vc = config.vision_config
    for key, supported in SUPPORTED.items():
        value = getattr(vc, key, None)
        if value not in supported:
            raise ValueError(f"vision_config.{key} = {value!r} is not supported; supported: {list(supported)}")
    heads, qkv = vc.vt_num_attention_heads, _qkv_width(vc)
    if qkv % heads or (qkv // heads) % 4:
        raise ValueError(
            f"vision_config.qkv_hidden_size = {qkv} must split into vt_num_attention_heads = {heads} heads whose "
            "dim is a multiple of 4 (2D rotary embedding)"
        )
    if vc.mm_hidden_size != vc.vt_hidden_size:
        raise ValueError(
            f"vision_config.mm_hidden_size = {vc.mm_hidden_size} must equal vt_hidden_size = {vc.vt_hidden_size} "
            "(the projector consumes the ViT's merged patches)"
        )
    if len(vc.merge_kernel_size) != 2:
        raise ValueError(f"vision_config.merge_kernel_size = {vc.merge_kernel_size!r} must be [kh, kw]")
    if vc.text_hidden_size != config.text_config.hidden_size:
        raise ValueError(
            f"vision_config.text_hidden_size = {vc.text_hidden_size} differs from text_config.hidden_size = "
            f"{config.text_config.hidden_size}"
        )


def _qkv_width(vc: KimiK3VisionConfig) -> int:
    return vc.vt_hidden_size if vc.qkv_hidden_size is None else vc.qkv_hidden_size


def _norm(norm_type: str, dim: int) -> nn.Module:
    """torch's RMSNorm (default eps) or LayerNorm over `dim`, as `norm_type` says."""
    return nn.RMSNorm(dim) if norm_type == "rmsnorm" else nn.LayerNorm(dim)


def sincos_1d(dim: int, length: int, device=None) -> torch.Tensor:
    """Fixed sin-cos embedding of positions 0..length-1: [length, dim] fp32, sin half then cos half."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    angles = torch.arange(length, dtype=torch.float64, device=device)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class KimiVisionPosEmb(nn.Module):
    """Learned [H0, W0, D] position table, resized to each image's (h, w) grid; frames t > 1 also get a fixed
    sin-cos time embedding (computed on the fly, never stored)."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        self.num_frames = vc.init_pos_emb_time
        self.interpolation_mode = vc.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.empty(vc.init_pos_emb_height, vc.init_pos_emb_width, vc.vt_hidden_size))

    def grid(self, h: int, w: int) -> torch.Tensor:
        """The table at an (h, w) grid: [h * w, D], row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.interpolation_mode)
        return table[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, x_ND: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> torch.Tensor:
        """x_ND [N, D] + the position embedding of every image's (t, h, w) patches."""
        pieces = []
        for t, h, w in grid_thws:
            pos = self.grid(h, w)
            if t > 1:
                time = sincos_1d(pos.shape[-1], t, pos.device)[:, None, :]
                pos = (pos[None].float() + time).flatten(0, 1)
            pieces.append(pos.to(x_ND.dtype))
        return x_ND + torch.cat(pieces, dim=0)


class KimiVisionPatchEmbed(nn.Module):
    """Conv2d patch projection [N, 3, p, p] -> [N, D], then the position embedding."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        p = vc.patch_size
        self.proj = nn.Conv2d(3, vc.vt_hidden_size, kernel_size=p, stride=p, bias=vc.patch_embed_proj_bias)
        self.pos_emb = KimiVisionPosEmb(vc)

    def forward(self, pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> torch.Tensor:
        x_ND = self.proj(pixel_values).flatten(1)
        return self.pos_emb(x_ND, grid_thws)


class KimiVisionRope2D(nn.Module):
    """2D rotary embedding for the ViT: head dim d in complex pairs; pair 2i rotates by the patch's column,
    pair 2i+1 by its row, both at frequency theta^(-4i/d), i < d/4. Frames of one image share positions."""

    def __init__(self, head_dim: int, max_grid: int = ROPE_MAX_GRID, theta: float = ROPE_THETA):
        super().__init__()
        self.head_dim, self.max_grid, self.theta = head_dim, max_grid, theta

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_grid={self.max_grid}, theta={self.theta}"

    def grid_freqs(self, h: int, w: int, device=None) -> torch.Tensor:
        """cis(angles) of an (h, w) grid: complex64 [h * w, d/2], row-major."""
        freqs = self.theta ** (-torch.arange(0, self.head_dim, 4, device=device).float() / self.head_dim)
        rows = torch.arange(h, device=device).float()[:, None, None] * freqs  # [h, 1, d/4]
        cols = torch.arange(w, device=device).float()[None, :, None] * freqs  # [1, w, d/4]
        angles = torch.stack([cols.expand(h, w, -1), rows.expand(h, w, -1)], dim=-1)  # [h, w, d/4, 2]
        return torch.polar(torch.ones_like(angles), angles).reshape(h * w, self.head_dim // 2)

    def forward(self, grid_thws: list[tuple[int, int, int]], device=None) -> torch.Tensor:
        """complex64 [N, d/2] for all images' patches, in `pixel_values` order."""
        for _, h, w in grid_thws:
            if not (1 <= h <= self.max_grid and 1 <= w <= self.max_grid):
                raise ValueError(f"image grid {h}x{w} is outside the rotary table's {self.max_grid}x{self.max_grid}")
        return torch.cat([self.grid_freqs(h, w, device).repeat(t, 1) for t, h, w in grid_thws], dim=0)


def apply_rope_2d(x_NAd: torch.Tensor, freqs_Nc: torch.Tensor) -> torch.Tensor:
    """Rotate [N, A, d] queries or keys by complex [N, d/2] (adjacent dims form one complex pair); in fp32."""
    x = torch.view_as_complex(x_NAd.float().reshape(*x_NAd.shape[:-1], -1, 2))
    return torch.view_as_real(x * freqs_Nc[:, None, :]).flatten(-2).type_as(x_NAd)


class KimiVisionMLP(nn.Module):
    """mlp2: fc0 [D -> I], tanh-approximated GELU, fc1 [I -> D]."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(vc.vt_hidden_size, vc.vt_intermediate_size, bias=vc.linear_bias)
        self.fc1 = nn.Linear(vc.vt_intermediate_size, vc.vt_hidden_size, bias=vc.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class KimiVisionBlock(nn.Module):
    """Pre-norm ViT block: packed wqkv [D -> 3Q], 2D rope on q/k, attention within each image, wo [Q -> D]."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        self.num_heads = vc.vt_num_attention_heads
        qkv = _qkv_width(vc)
        self.norm0 = _norm(vc.norm_type, vc.vt_hidden_size)
        self.norm1 = _norm(vc.norm_type, vc.vt_hidden_size)
        self.wqkv = nn.Linear(vc.vt_hidden_size, 3 * qkv, bias=vc.attn_bias)
        self.wo = nn.Linear(qkv, vc.vt_hidden_size, bias=vc.attn_bias)
        self.mlp = KimiVisionMLP(vc)

    def attention(self, x_ND: torch.Tensor, lengths: list[int], freqs_Nc: torch.Tensor) -> torch.Tensor:
        """x_ND [N, D] -> [N, D]; `lengths` are the images' patch counts (no attention across images)."""
        N = x_ND.shape[0]
        q, k, v = self.wqkv(x_ND).view(N, 3, self.num_heads, -1).unbind(1)  # each [N, A, d]
        q, k = apply_rope_2d(q, freqs_Nc), apply_rope_2d(k, freqs_Nc)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            out = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(out.transpose(0, 1).flatten(1))  # [n, Q]
        return self.wo(torch.cat(outs, dim=0))

    def forward(self, x_ND: torch.Tensor, lengths: list[int], freqs_Nc: torch.Tensor) -> torch.Tensor:
        x_ND = x_ND + self.attention(self.norm0(x_ND), lengths, freqs_Nc)
        return x_ND + self.mlp(self.norm1(x_ND))


class KimiVisionEncoder(nn.Module):
    """The ViT blocks (sharing one 2D rope) and the final norm: [N, D] -> [N, D]."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        self.rope_2d = KimiVisionRope2D(_qkv_width(vc) // vc.vt_num_attention_heads)
        self.blocks = nn.ModuleList([KimiVisionBlock(vc) for _ in range(vc.vt_num_hidden_layers)])
        self.final_layernorm = _norm(vc.norm_type, vc.vt_hidden_size)

    def forward(self, x_ND: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> torch.Tensor:
        freqs_Nc = self.rope_2d(grid_thws, x_ND.device)
        lengths = [t * h * w for t, h, w in grid_thws]
        for block in self.blocks:
            x_ND = block(x_ND, lengths, freqs_Nc)
        return self.final_layernorm(x_ND)


def tpool_merge(x_ND: torch.Tensor, grid_thws: list[tuple[int, int, int]], kernel: list[int]) -> list[torch.Tensor]:
    """sd2_tpool: mean over each image's frames, then group kh x kw neighbours.

    Returns one [(h/kh) * (w/kw), kh * kw, D] per image, merged cells row-major, each cell's patches row-major.
    """
    kh, kw = kernel
    D = x_ND.shape[-1]
    out = []
    for x, (t, h, w) in zip(x_ND.split([t * h * w for t, h, w in grid_thws]), grid_thws):
        x = x.view(t, h // kh, kh, w // kw, kw, D).permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        out.append(x.reshape((h // kh) * (w // kw), kh * kw, D))
    return out


class KimiVisionTower(nn.Module):
    """patch_embed -> encoder -> sd2_tpool merge. Returns one [(h/kh)*(w/kw), kh*kw, D] per image."""

    def __init__(self, vc: KimiK3VisionConfig):
        super().__init__()
        self.config = vc
        self.patch_embed = KimiVisionPatchEmbed(vc)
        self.encoder = KimiVisionEncoder(vc)

    def check_grid(self, pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> None:
        """Raise ValueError where `grid_thws` does not describe `pixel_values` or the merge cannot tile it."""
        (kh, kw), max_t = self.config.merge_kernel_size, self.config.init_pos_emb_time
        for t, h, w in grid_thws:
            if t < 1 or h < 1 or w < 1 or h % kh or w % kw:
                raise ValueError(f"grid (t, h, w) = {(t, h, w)} must be positive with h % {kh} == 0 and w % {kw} == 0")
            if t > max_t:
                raise ValueError(f"grid t = {t} exceeds vision_config.init_pos_emb_time = {max_t}")
        total = sum(t * h * w for t, h, w in grid_thws)
        p = self.config.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p) or pixel_values.shape[0] != total:
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} must be [{total}, 3, {p}, {p}] for grid_thws {grid_thws}"
            )

    def forward(self, pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        self.check_grid(pixel_values, grid_thws)
        x_ND = self.patch_embed(pixel_values, grid_thws)
        x_ND = self.encoder(x_ND, grid_thws)
        return tpool_merge(x_ND, grid_thws, self.config.merge_kernel_size)


class KimiMMProjector(nn.Module):
    """patchmergerv2: merged cell (kh*kw*D) -> Linear -> GELU -> Linear -> H -> RMSNorm (no biases)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        vc = config.vision_config
        merged = vc.mm_hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        H = config.text_config.hidden_size
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), nn.GELU(), nn.Linear(merged, H, bias=False))
        self.post_norm = nn.RMSNorm(H, eps=vc.projector_ln_eps)

    def forward(self, cells: list[torch.Tensor]) -> list[torch.Tensor]:
        """One [n, kh*kw, D] per image -> one [n, H] per image."""
        lengths = [c.shape[0] for c in cells]
        x = torch.cat([c.reshape(c.shape[0], -1) for c in cells], dim=0)
        return list(self.post_norm(self.proj(x)).split(lengths))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer", "KimiVisionBlock"]
    _can_compile_fullgraph = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, KimiVisionPosEmb):
            nn.init.normal_(module.weight, std=0.02)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        check_vision_config(config)
        self.vision_tower = KimiVisionTower(config.vision_config)
        self.mm_projector = KimiMMProjector(config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [N, 3, p, p], grid_thws [num_images, 3] (t, h, w). Returns one [(h/kh)*(w/kw), H] per image."""
        grid_thws = torch.as_tensor(grid_thws)
        if grid_thws.ndim != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws must be [num_images, 3] (t, h, w), got shape {tuple(grid_thws.shape)}")
        grid = [tuple(int(v) for v in thw) for thw in grid_thws.tolist()]
        cells = self.vision_tower(pixel_values.to(self.vision_tower.patch_embed.proj.weight.dtype), grid)
        return self.mm_projector(cells)

    def _merge_with_image_features(self, input_ids, inputs_embeds, attention_mask, image_features):
        """Expand each placeholder into its image's rows; rows are right-padded to the longest one."""
        token_id = self.config.media_placeholder_token_id
        num_placeholders = (input_ids == token_id).sum().item()
        if num_placeholders != len(image_features):
            raise ValueError(
                f"{num_placeholders} image placeholder tokens in input_ids but {len(image_features)} images"
            )
        feature_lengths = [f.shape[0] for f in image_features]
        rows, masks, next_image = [], [], 0
        for b in range(input_ids.shape[0]):
            pieces, mask_pieces = [], []
            positions = (input_ids[b] == token_id).nonzero().flatten().tolist()
            start = 0
            for pos in positions:
                pieces.append(inputs_embeds[b, start:pos])
                pieces.append(image_features[next_image].to(inputs_embeds.dtype))
                if attention_mask is not None:
                    mask_pieces.append(attention_mask[b, start:pos])
                    mask_pieces.append(attention_mask.new_ones(feature_lengths[next_image]))
                next_image += 1
                start = pos + 1
            pieces.append(inputs_embeds[b, start:])
            rows.append(torch.cat(pieces, dim=0))
            if attention_mask is not None:
                mask_pieces.append(attention_mask[b, start:])
                masks.append(torch.cat(mask_pieces, dim=0))
        new_len = max(r.shape[0] for r in rows)
        embeds = inputs_embeds.new_zeros(len(rows), new_len, inputs_embeds.shape[-1])
        new_mask = torch.zeros(len(rows), new_len, dtype=torch.long, device=inputs_embeds.device)
        for b, r in enumerate(rows):
            embeds[b, : r.shape[0]] = r
            new_mask[b, : r.shape[0]] = masks[b] if attention_mask is not None else 1
        return embeds, new_mask

    def forward(
        self,
        input_ids=None,
        pixel_values=None,
        grid_thws=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            if input_ids is None or grid_thws is None:
                raise ValueError("pixel_values need input_ids with image placeholders and grid_thws")
            image_features = self.get_image_features(pixel_values, grid_thws)
            inputs_embeds, attention_mask = self._merge_with_image_features(
                input_ids, inputs_embeds, attention_mask, image_features
            )
        out = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
        loss = None
        if labels is not None:
            if labels.shape[1] != out.logits.shape[1]:
                raise ValueError("labels must cover the merged sequence when images are given")
            logits = out.logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, past_key_values=out.past_key_values)
