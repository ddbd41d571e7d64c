"""Context-parallel attention strategies; each maps local q/k/v to the local attention output."""
from .allgather import allgather_attention
from ..layout.masks import MaskSpec
from .ring import ring_attention
from .ulysses import check_heads, ulysses_attention
from .usp import UspGroups, build_usp_groups, check_ulysses_size, usp_attention
from ..state import STRATEGY_NAMES

STRATEGIES = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
              "usp": usp_attention}
assert sorted(STRATEGIES) == sorted(STRATEGY_NAMES), "hfcp.state.STRATEGY_NAMES must name every strategy"

__all__ = ["STRATEGIES", "MaskSpec", "check_heads", "UspGroups", "build_usp_groups", "check_ulysses_size"]
