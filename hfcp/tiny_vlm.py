"""Moved to hfcp.testing.tiny_vlm; this name stays for one release."""
import sys

from .testing import tiny_vlm as _moved

sys.modules[__name__] = _moved
