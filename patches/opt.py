"""OPT: verified exact by the family sweep (attention read from the model), with one piece of family knowledge:
given no position_ids, OPTModel derives them from the attention mask (cumsum(mask) * mask - 1), so left padding
and holes in the mask shift every later position. hfcp computes them so over the whole mask before splitting."""
from hfcp.families.registry import Patcher, register_patcher

from .verified import TRANSFORMERS_VERSION

register_patcher(Patcher(model_type="opt", attention_classes=(), read_from_model=True,
                         verified_with=TRANSFORMERS_VERSION, positions_from_mask=True))
