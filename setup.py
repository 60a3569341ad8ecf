"""Packaging beyond setup.cfg: the Hydra configs travel inside the package as `specgen.configs`, so that a
non-editable install runs `python -m specgen.train` / `specgen.eval` (see `specgen.utils.locations`)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages("src") + ["specgen.configs"],
    package_dir={"": "src", "specgen.configs": "configs"},
    package_data={"specgen.configs": ["**/*.yaml", "**/*.json"]},
)
