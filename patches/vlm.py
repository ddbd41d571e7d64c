"""Vision-language models whose language model reads the merged token sequence (text embeddings with the image
features scattered in): hfcp shards at the language model's input (hfcp/vlm_hooks.py). The language model's
attention modules are read from it and checked like any read-from-model family; masks the outer model builds are
hfcp's predicate or refused at run time. Each type here is tested against the unpatched model (tests/test_vlm.py)."""
from hfcp.registry import Patcher, register_patcher

VLM_TYPES = (
    "llava",      # CLIP / SigLIP tower, projector, any text family (2D positions)
    "qwen2_vl",   # Qwen2-VL: 3D mRoPE positions from the rope index over the whole input_ids and grids
    "qwen2_5_vl", # Qwen2.5-VL: the same with a windowed vision tower
    "internvl",   # InternVL: InternViT tiles, pixel shuffle, projector
    "idefics3",   # Idefics3: pixel shuffle, images per row as (B, N, C, H, W)
    "smolvlm",    # SmolVLM: the same architecture
)

for _type in VLM_TYPES:
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True, language_model=True))

# the language models of the Qwen-VL types (a VLM's record takes its text record's family knowledge: there is
# none to add for these); exact as part of their VLM, tested there
for _type in ("qwen2_vl_text", "qwen2_5_vl_text"):
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True))
