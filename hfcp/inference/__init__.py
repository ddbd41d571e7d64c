"""Generation under CP: generate() on a patched model and the KV cache spread over the ranks."""
