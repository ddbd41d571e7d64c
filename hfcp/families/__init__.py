"""Model knowledge, as data: the registry of records, what hfcp reads from a model (introspection), and how patch
resolves a model to its record and plan. The records themselves live in patches/ (installed as hfcp.patches)."""
