"""Vision-language models whose language model reads the merged token sequence (text embeddings with the image
features scattered in): hfcp shards at the language model's input (hfcp/vlm_hooks.py). The language model's
attention modules are read from it and checked like any read-from-model family; masks the outer model builds are
hfcp's predicate or refused at run time. Each type here is tested against the unpatched model (tests/test_vlm.py)."""
from hfcp.registry import Patcher, register_patcher

VLM_TYPES = {  # model_type: the vision tower's path where it encodes each image on its own (split over the ranks)
    "llava": "model.vision_tower",      # CLIP / SigLIP tower, projector, any text family (2D positions)
    "qwen2_vl": "model.visual",         # 3D mRoPE positions from the rope index over all input_ids and grids; its
    "qwen2_5_vl": "model.visual",       # tower takes every image's patches as one sequence with grid_thw rows
    "internvl": "model.vision_tower",   # InternViT tiles, pixel shuffle, projector
    "idefics3": "model.vision_model",   # pixel shuffle, images per row as (B, N, C, H, W)
    "smolvlm": "model.vision_model",    # the same architecture
}

for _type, _tower in VLM_TYPES.items():
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True, language_model=True,
                             vision_tower=_tower))

# the language models of the Qwen-VL types (a VLM's record takes its text record's family knowledge: there is
# none to add for these); exact as part of their VLM, tested there
for _type in ("qwen2_vl_text", "qwen2_5_vl_text"):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True))
