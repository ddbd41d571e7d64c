"""The one guard of records that run a family's own code or reproduce it: the code must be the code the record
verified. A record lists a fingerprint (a hash of the source) for each function hfcp runs, rebinds or reproduces;
another transformers version, or a user's subclass, whose code differs in any way is refused before anything is
bound. After checking a new transformers version exact (the family sweep), a maintainer prints the new fingerprints
with `fingerprints_of` and updates the record."""
from __future__ import annotations

import functools
import hashlib
import inspect
import sys


@functools.lru_cache(maxsize=1024)  # per function object: patch checks the same classes' code again and again
def source_fingerprint(function) -> str:
    """The first 16 hex digits of the sha256 of `function`'s source (decorators unwrapped); "" without source."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return ""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _code_of(cls, name: str):
    """`cls`'s attribute `name` (its method), else the function `name` of the module that defines `cls` (a kernel its
    forward calls); None without either."""
    found = getattr(cls, name, None)
    if found is None:
        found = getattr(sys.modules.get(cls.__module__), name, None)
    return found


def fingerprints_of(cls, names) -> dict:
    """{"Class.name": fingerprint} of `cls`'s code named in `names` (see _code_of), to write into a record."""
    return {f"{cls.__name__}.{name}": source_fingerprint(_code_of(cls, name)) for name in names}


def check_source(module, fingerprints: dict, version: str) -> None:
    """Raises ValueError unless each piece of code of `module`'s class named in `fingerprints` ("Class.name" ->
    source_fingerprint; name is a method of the class, or a function of its module) has the source the record
    verified with transformers `version`."""
    cls = type(module).__name__
    mine = {key: want for key, want in fingerprints.items() if key.partition(".")[0] == cls}
    if not mine:
        raise ValueError(f"hfcp: no verified source for {cls}: this transformers version is not supported")
    for key, want in mine.items():
        if source_fingerprint(_code_of(type(module), key.partition(".")[2])) != want:
            raise ValueError(f"hfcp: {key} is not the code hfcp verified (transformers {version}): this transformers "
                             "version (or a subclass) is not supported")
