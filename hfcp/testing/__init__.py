"""Tiny random-weight models built from transformers' own configs, for tests, `hfcp verify` and examples."""
