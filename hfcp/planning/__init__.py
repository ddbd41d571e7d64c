"""hfcp.plan: what a training step of a model needs per rank at a given length and layout, and the longest length
that fits a device; the dry run behind it (the real patched step on the meta device in a fake world)."""
from .plan import Plan, layouts, plan, search, table  # noqa: F401
from .trace import dry_run  # noqa: F401
