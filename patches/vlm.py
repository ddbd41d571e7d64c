"""Vision-language models whose language model reads the merged token sequence (text embeddings with the image
features scattered in): hfcp shards at the language model's input (hfcp/vlm_hooks.py). The language model's
attention modules are read from it and checked like any read-from-model family; masks the outer model builds are
hfcp's predicate or refused at run time. Each type here is tested against the unpatched model (tests/test_vlm.py)."""
from hfcp.registry import Patcher, register_patcher

VLM_TYPES = {  # model_type: (language model, vision tower), module paths in the outer model
    "llava": ("model.language_model", "model.vision_tower"),     # CLIP / SigLIP tower, projector, any text family
    "qwen2_vl": ("model.language_model", "model.visual"),        # 3D mRoPE positions from the rope index; its tower
    "qwen2_5_vl": ("model.language_model", "model.visual"),      # takes every image's patches as one sequence
    "internvl": ("model.language_model", "model.vision_tower"),  # InternViT tiles, pixel shuffle, projector
    "idefics3": ("model.text_model", "model.vision_model"),      # pixel shuffle, images per row (B, N, C, H, W)
    "smolvlm": ("model.text_model", "model.vision_model"),       # the same architecture
    "gemma3": ("model.language_model", "model.vision_tower"),    # SigLIP; image blocks bidirectional (token_type_ids)
    "paligemma": ("model.language_model", "model.vision_tower"), # SigLIP; the prefix is one bidirectional block
}

for _type, (_language_model, _tower) in VLM_TYPES.items():
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             language_model=_language_model, vision_tower=_tower))

# the language models of the Qwen-VL types (a VLM's record takes its text record's family knowledge: there is
# none to add for these); exact as part of their VLM, tested there
for _type in ("qwen2_vl_text", "qwen2_5_vl_text"):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True))
