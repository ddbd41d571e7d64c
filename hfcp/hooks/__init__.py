"""accelerate hooks, and what hfcp.patch attaches (attach): one module per model kind, causal LMs (causal_lm, with the
classification heads: heads), vision-language models (vlm), ViT and video models (vit); the tower split of images,
frames and audio clips (tower_split) with its synced batch norms, per-token side inputs, dynamic RoPE, the MoE
router's statistics (router)."""
