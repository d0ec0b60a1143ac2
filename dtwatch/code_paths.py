"""Which code a file holds: torch or dtwatch, the standard library, a third-party library, or the user's own.

Every frame's code is classified once by its file name (cached):

* ``INTERNAL``: torch, dtwatch, ``<frozen ...>`` modules and code torch generates (torch.fx graph modules,
  inductor's compiled modules): never a call site;
* ``OTHER``: the standard library and other pseudo-files (``<string>``, ``<stdin>``): a call site if
  nothing better is outside torch, never the user's line;
* ``LIBRARY``: third-party code, i.e. a file with a ``site-packages`` or ``dist-packages`` directory
  in its path (Lightning, Accelerate, transformers, ...);
* ``USER``: everything else: the user's own code.

Nothing is imported to decide it: torch is located with ``importlib.util.find_spec``, so the watchdog and
``dtwatch analyze`` classify call sites without loading torch.
"""
from __future__ import annotations

import importlib.util
import os
import sysconfig

INTERNAL, OTHER, LIBRARY, USER = 0, 1, 2, 3


def _package_dir(name: str) -> str:
    """Where package ``name`` is installed, found without importing it (the watchdog and ``dtwatch analyze`` read
    call sites without torch loaded); "" where it is not installed (its files then classify by path alone)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.abspath(locations[0]) + os.sep if locations else ""


_TORCH_DIR = _package_dir("torch")
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # dtwatch itself
_STDLIB_DIRS = tuple(
    {os.path.abspath(p) + os.sep for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p}
)
_LIBRARY_DIRS = ("site-packages", "dist-packages")
# Code torch generates at run time: frozen modules, torch.fx graph modules (``<eval_with_key>.3``, what a
# ``torch.compile``d graph runs as under the eager backends), and inductor's compiled modules, which live
# in its cache directory (``/tmp/torchinductor_<user>/...``, or wherever TORCHINDUCTOR_CACHE_DIR says).
_GENERATED_PSEUDO_FILES = ("<frozen", "<eval_with_key")
_INDUCTOR_CACHE = "torchinductor_"


def site_file(filename: str) -> str:
    """The file name a site records: absolute, except pseudo-files (``<string>``, ``<frozen ...>``)."""
    return filename if filename.startswith("<") else os.path.abspath(filename)


def classify_file(filename: str) -> int:
    """``INTERNAL`` / ``OTHER`` / ``LIBRARY`` / ``USER`` of a code object's file name (see the module doc)."""
    if filename.startswith("<"):
        return INTERNAL if filename.startswith(_GENERATED_PSEUDO_FILES) else OTHER
    path = os.path.abspath(filename)
    if (_TORCH_DIR and path.startswith(_TORCH_DIR)) or path.startswith(PACKAGE_DIR):
        return INTERNAL
    parts = path.split(os.sep)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if any(d.startswith(_INDUCTOR_CACHE) for d in parts[:-1]) or (cache and path.startswith(os.path.abspath(cache))):
        return INTERNAL  # code torch.compile generated (inductor's cache), never the user's line
    lib = max((i for i, d in enumerate(parts) if d in _LIBRARY_DIRS), default=-1)
    if lib >= 0:  # checked before the standard library: site-packages often lies inside it
        # torch or dtwatch of another environment (e.g. paths in a Flight Recorder dump read elsewhere)
        return INTERNAL if parts[lib + 1 : lib + 2] in (["torch"], ["dtwatch"]) else LIBRARY
    if path.startswith(_STDLIB_DIRS):
        return OTHER
    return USER


def is_user_file(filename: str) -> bool:
    return classify_file(filename) == USER
