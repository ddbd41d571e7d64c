"""Moved to hfcp.testing.tiny; this name stays for one release."""
import sys

from .testing import tiny as _moved

sys.modules[__name__] = _moved
