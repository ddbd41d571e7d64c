"""accelerate hooks, one module per model kind: causal LMs (causal_lm), vision-language models (vlm), vision and
video models (vision), the vision tower split (vision_tower), per-token side inputs, dynamic RoPE."""
