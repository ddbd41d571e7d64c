"""Running a family's own forward code with some of what it calls replaced: the two ways records do it.

- `with_globals`: the function with some of the module-level names it reads bound to others (the recurrent layers'
  padding rule, convolution and scan);
- `ModuleView`: a module whose code reads some attributes from hfcp instead (RecurrentGemma's convolution and scan).

Either way the code is the family's, checked first against the record's fingerprints (hfcp/families/source_guard.py)."""
from __future__ import annotations

import types


def with_globals(function, **names):
    """`function`'s code (decorators unwrapped by the caller) with `names` bound in place of its module's globals."""
    bound = types.FunctionType(function.__code__, dict(function.__globals__, **names), function.__name__,
                               function.__defaults__, function.__closure__)
    bound.__kwdefaults__ = function.__kwdefaults__
    return bound


class ModuleView:
    """`module` with some attributes replaced, for the family's forward code to run on unchanged; what that code
    assigns to itself (the decode states) stays on the view."""

    def __init__(self, module, **replaced):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_replaced", replaced)

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)

    def __setattr__(self, name, value):
        self._replaced[name] = value
