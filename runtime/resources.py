"""Files spectrt reads at run time, located inside the installed package (never by climbing to a checkout).

They ship as package data (pyproject.toml `[tool.setuptools.package-data]`): the Triton model repository
(`triton_repo/`), the native kernel source (`runtime/engines/cpu_kernels.cpp`), the prompt sets (`bench/*.txt`,
`build/prompts/*.txt`) and the embedded target's shipped answers (`build/answers/`). In an editable install of
a checkout the package is the checkout itself, so the same paths point into it.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_path(relative: str) -> Path:
    """The file or directory `spectrt/<relative>` of the installed package, as a filesystem path.

    It is not checked here (a module computes its defaults at import); whoever reads it says what is missing.
    """
    root = files("spectrt")
    if not isinstance(root, Path):  # e.g. imported from a zip: TensorRT, tritonserver and g++ need real files
        raise RuntimeError(f"spectrt is installed as {root!r}, not as files on disk: install it with pip "
                           "(`pip install spectrt-*.whl`), which unpacks it")
    return root / relative
