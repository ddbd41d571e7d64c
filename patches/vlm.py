"""Vision-language models whose language model reads the merged token sequence (text embeddings with the image
features scattered in): hfcp shards at the language model's input (hfcp/hooks/vlm.py). The language model and the
vision tower are read from the model ("auto": the outermost modules whose configs are its text and vision configs);
the language model's attention modules are read from it and checked like any read-from-model family, and masks the
outer model builds are hfcp's predicate or refused at run time. The tower's images are split over the CP group
(hfcp/hooks/tower_split.py: each image encoded on its own). Each type here is tested against the unpatched model
(tests/hooks/test_vlm.py); patches/verified_vlm.py adds the types the VLM sweep showed exact."""
from hfcp.families.registry import Patcher, register_patcher
from hfcp.families.towers import register_per_image_tower

# towers that encode each image (or each Qwen-VL grid, attention within it by cu_seqlens) on its own: split over the
# CP group. Any other tower of a supported VLM runs whole on every rank (exact; its memory does not fall with cp)
PER_IMAGE_TOWERS = ("clip_vision_model", "siglip_vision_model", "internvl_vision", "idefics3_vision",
                    "smolvlm_vision")
# Qwen-VL towers: patch embedding, attention (cu_seqlens and windows) and position embeddings all within each
# temporal frame, so a video's frames are split too (one long video shared over the group)
PER_FRAME_TOWERS = ("qwen2_vl_vision", "qwen2_5_vl_vision", "qwen3_vl_vision", "qwen3_vl_moe_vision",
                    "qwen3_5_vision", "qwen3_5_moe_vision")  # Qwen3.5: Qwen3-VL's tower without deepstack
for _tower in PER_IMAGE_TOWERS:
    register_per_image_tower(_tower)
for _tower in PER_FRAME_TOWERS:
    register_per_image_tower(_tower, frames_alone=True)

VLM_TYPES = (
    "llava",       # CLIP / SigLIP tower, projector, any text family
    "qwen2_vl",    # 3D mRoPE positions from the rope index; its tower takes every image's patches as one sequence
    "qwen2_5_vl",  # windowed vision attention
    "qwen3_vl",    # deepstack: vision features added to the first text layers' visual tokens (side inputs)
    "internvl",    # InternViT tiles, pixel shuffle, projector
    "idefics3",    # pixel shuffle, images per row (B, N, C, H, W)
    "smolvlm",     # the same architecture
    "gemma3",      # SigLIP; image blocks bidirectional (token_type_ids)
    "paligemma",   # SigLIP; the prefix is one bidirectional block
)

for _type in VLM_TYPES:
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             language_model="auto", vision_tower="auto"))

# the language models of the Qwen-VL types (a VLM's record takes its text record's family knowledge); exact as
# part of their VLM, tested there. Qwen3-VL's passes per-token side inputs: its visual positions and the deepstack
# rows for them, split by hfcp with the tokens
for _type in ("qwen2_vl_text", "qwen2_5_vl_text"):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True))
register_patcher(Patcher(model_type="qwen3_vl_text", attention_classes=(), read_from_model=True,
                         token_side_inputs=(("visual_pos_masks", "deepstack_visual_embeds"),)))
# Qwen3-VL-MoE's language model: Qwen3-VL's deepstack side inputs, MoE MLPs (token-wise). Exact patched alone
# (hfcp.patch(model.model.language_model)) with output_router_logits off (tests/hooks/test_vlm.py)
register_patcher(Patcher(model_type="qwen3_vl_moe_text", attention_classes=(), read_from_model=True,
                         token_side_inputs=(("visual_pos_masks", "deepstack_visual_embeds"),)))
