"""The sweeps over every family transformers ships (causal LMs: families, vision-language models: vlms, audio: audio,
classification heads: heads), each run on every rank of a DistPool, compared with one process. The tests read them
(tests/sweeps/test_families.py, test_vlm_sweep.py, test_audio.py) and scripts/tools/support_matrix.py regenerates the
records and tables they back."""
