"""Package discovery: every package under hfcp/, and the family records of patches/ installed as hfcp.patches.

The metadata lives in pyproject.toml; only the package list is computed here, so that a new subpackage
cannot be left out of the installed package (tests/e2e/test_packaging.py builds a wheel and checks it).
"""
from setuptools import find_packages, setup

RECORDS = {"hfcp.patches" + ("." + sub if sub else ""): "patches" + ("/" + sub.replace(".", "/") if sub else "")
           for sub in [""] + find_packages("patches")}

setup(
    packages=find_packages(include=["hfcp", "hfcp.*"]) + sorted(RECORDS),
    package_dir=RECORDS,
    package_data={"hfcp.planning.configs": ["*.json"]},  # (hfcp plan's shipped configs)
)
