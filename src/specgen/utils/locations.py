"""Where the configs and the repository's folders are, in a clone and in an installed package.

In a clone (or an editable install) both are the repository's: `configs/` and the root that holds
`checkpoints/`, `data/` and `logs/`. A non-editable `pip install .` carries the configs inside the
package (`specgen/configs`, see setup.py); the root is then `$SPECGEN_ROOT` when set, else the working
directory (run from a clone to find its shipped checkpoints, or set `paths.root_dir`).
"""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # src/specgen, or site-packages/specgen
_CLONE = _PACKAGE.parents[1]                     # the repository, when the package sits in its src/


def in_clone() -> bool:
    return (_CLONE / "configs").is_dir() and (_CLONE / "src" / "specgen").resolve() == _PACKAGE


def config_dir() -> Path:
    """The Hydra config folder: the clone's `configs/`, else the copy installed in the package."""
    path = _CLONE / "configs" if in_clone() else _PACKAGE / "configs"
    if not path.is_dir():
        raise FileNotFoundError(f"no config folder at {path}: reinstall specgen (`pip install .` from a clone "
                                f"copies configs/ into the package) or run from a clone")
    return path


def repo_root() -> Path:
    """The root of checkpoints/, data/ and logs/: `$SPECGEN_ROOT`, else the clone, else the working directory."""
    if os.environ.get("SPECGEN_ROOT"):
        return Path(os.environ["SPECGEN_ROOT"]).resolve()
    return _CLONE if in_clone() else Path.cwd().resolve()
