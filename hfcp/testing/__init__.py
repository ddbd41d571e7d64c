"""What hfcp's tests, tools and `hfcp verify` share: tiny random-weight models built from transformers' own configs
(tiny, tiny_vlm, tiny_audio, tiny_vision), packed rows (packed_rows), how results are compared (compare) and memory
measured (memory), the pool of gloo worker processes (dist_pool) and the family sweeps (sweeps/)."""
