"""Where localspec finds its shipped data and keeps its own files."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def data_path(name: str) -> Path:
    """A shipped data file or folder (`presets`, `models.toml`).

    Wheels carry them under `localspec/_data/`; an editable install or a source checkout reads them from the
    repository root, where they live once.
    """
    packaged = Path(str(resources.files("localspec"))) / "_data" / name
    if packaged.exists():
        return packaged
    return Path(__file__).resolve().parent.parent / name


def home() -> Path:
    """`$LOCALSPEC_HOME`, else the platform's config dir (`$XDG_CONFIG_HOME/localspec` or `~/.config/localspec`)."""
    env = os.environ.get("LOCALSPEC_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "localspec"


def cache_dir() -> Path:
    """Files localspec derives itself (the assembled demo model). Under `home()` so one variable moves it all."""
    return home() / "cache"
