"""Moved to hfcp.inference.kv_cache; this name stays for one release."""
import sys

from .inference import kv_cache as _moved

sys.modules[__name__] = _moved
