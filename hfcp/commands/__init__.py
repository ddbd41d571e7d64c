"""The `hfcp` command line: `hfcp verify` (a patched model against the unpatched one)."""
