"""The reach options of hfcp.patch: what lets a longer sequence fit a device, each exact and each refused by name
where it would not be.

- `tiled_mlp.py`: a decoder layer's MLP over tiles of the sequence, each tile recomputed in backward alone.
- `norm_recompute.py`: the norm before a tiled MLP recomputed from its input instead of kept for backward.
- `offload.py`: what checkpointed layers keep for backward (each layer's input) held in host memory."""
