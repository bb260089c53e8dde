# Stand-in remote code for Kimi-K3, written by the modelopt_ext project from the public facts about the
# checkpoint (see docs/standin.md). The image merge keeps upstream's host-side feature lengths and `.item()`.
"""Kimi-K3 multimodal wrapper: ViT -> 2x2 patch merge -> mm_projector -> image tokens merged into text.

Shapes: N patches (all images), P = 3 * patch * patch pixels, D vision width, H text width, B batch, T time.
`pixel_values` [N, 3, patch, patch] holds every image's patches in row-major order; `image_grid_hws`
[num_images, 2] gives each image's patch grid (h, w). Each `media_placeholder_token_id` in `input_ids`
stands for one image and is expanded into that image's (h/2)*(w/2) feature rows.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_kimi_k3 import KimiK3Config, KimiK3VisionConfig
from .modeling_kimi_linear import KimiLinearForCausalLM, KimiRMSNorm

logger = logging.get_logger(__name__)


class KimiVisionMLP(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class KimiVisionBlock(nn.Module):
    """Pre-norm ViT block; attention runs within one image at a time."""

    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.norm0 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.mlp = KimiVisionMLP(config)

    def attention(self, x_ND, lengths):
        N, D = x_ND.shape
        qkv = self.wqkv(x_ND).view(N, 3, self.num_heads, D // self.num_heads)
        outs = []
        for q, k, v in zip(*(t.split(lengths) for t in qkv.unbind(1))):
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(-1, D))
        return self.wo(torch.cat(outs, dim=0))

    def forward(self, x_ND, lengths):
        x_ND = x_ND + self.attention(self.norm0(x_ND), lengths)
        return x_ND + self.mlp(self.norm1(x_ND))


class KimiVisionTower(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.pos_emb = nn.Parameter(
            torch.zeros(config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size)
        )
        self.blocks = nn.ModuleList([KimiVisionBlock(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values, grid_hws):
        """pixel_values [N, 3, p, p]; grid_hws as a Python list of (h, w). Returns one [h, w, D] per image."""
        x_ND = self.patch_embed(pixel_values).flatten(1)
        pos = [self.pos_emb[:h, :w].reshape(h * w, -1) for h, w in grid_hws]
        x_ND = x_ND + torch.cat(pos, dim=0).to(x_ND.dtype)
        lengths = [h * w for h, w in grid_hws]
        for block in self.blocks:
            x_ND = block(x_ND, lengths)
        x_ND = self.final_layernorm(x_ND)
        return [t.view(h, w, -1) for t, (h, w) in zip(x_ND.split(lengths), grid_hws)]


class KimiMMProjector(nn.Module):
    """Patch merger MLP: merged patches (area * D) -> (area * D) -> GELU -> H -> RMSNorm."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        vc = config.vision_config
        merged = vc.hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        self.linear_1 = nn.Linear(merged, merged)
        self.linear_2 = nn.Linear(merged, config.text_config.hidden_size)
        self.norm = KimiRMSNorm(config.text_config.hidden_size, eps=config.text_config.rms_norm_eps)

    def forward(self, x):
        return self.norm(self.linear_2(F.gelu(self.linear_1(x))))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer", "KimiVisionBlock"]
    _can_compile_fullgraph = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, KimiVisionTower):
            nn.init.normal_(module.pos_emb, std=0.02)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
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

    def get_image_features(self, pixel_values, image_grid_hws):
        """Returns a list with one [(h/2)*(w/2), H] tensor per image."""
        grid = [tuple(hw) for hw in image_grid_hws.tolist()]
        kh, kw = self.config.vision_config.merge_kernel_size
        features = []
        for x_hwD in self.vision_tower(pixel_values.to(self.vision_tower.patch_embed.weight.dtype), grid):
            h, w, D = x_hwD.shape
            merged = x_hwD.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw * D)
            features.append(self.mm_projector(merged))
        return features

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
        image_grid_hws=None,
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
            if input_ids is None or image_grid_hws is None:
                raise ValueError("pixel_values need input_ids with image placeholders and image_grid_hws")
            image_features = self.get_image_features(pixel_values, image_grid_hws)
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
