"""Maps the repository's top-level folders into the one installed namespace `deepinfer`.

pyproject.toml holds the metadata; setuptools reads the package list and folders from here because
a folder-to-package mapping (core/ -> deepinfer.core, ...) cannot be discovered by `packages.find`.
"""

import os

from setuptools import setup

PACKAGE_DIRS = {
    "deepinfer": "deepinfer",
    "deepinfer.cli": "deepinfer_cli",
    "deepinfer.configs": "configs",
    "deepinfer.core": "core",
    "deepinfer.kernels": "kernels",
    "deepinfer.validate": "validate",
}


def packages() -> list[str]:
    """Every folder with an __init__.py under a mapped root, as its dotted name in `deepinfer`."""
    found = []
    for package, folder in PACKAGE_DIRS.items():
        for here, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                found.append(package + here[len(folder):].replace(os.sep, "."))
    return found


setup(
    packages=packages(),
    package_dir=PACKAGE_DIRS,
    package_data={"deepinfer.kernels": ["*.cu", "*.cuh"], "deepinfer.configs": ["shapes/*.json"]},
)
