"""Model knowledge: one module per family, each registering a short declarative Patcher."""
from . import (audio, dinov2, llama, llama4, mistral, opt, qwen2, qwen3, timesformer, verified,  # noqa: F401
               verified_vlm, videomae, vit, vivit, vlm)
from . import lfm2  # noqa: F401,E402 - after verified: it replaces that record (the sweep's tiny LFM2 has no conv layer)
from . import minimax, recurrent, recurrent_gemma, sequence_heads  # noqa: F401,E402
