"""The package list, found rather than written down: every folder under packages/ is a part of the `dtrain`
namespace (packages/<name>/ is dtrain.<name>, its subfolders dtrain.<name>.<sub>), so a new package, a new
built-in workload's included, needs no line here or in pyproject.toml. Everything else about the packaging
(metadata, dependencies, package data) is in pyproject.toml; pyproject.toml cannot express this mapping,
since setuptools' `find` names what it finds relative to the folder searched (common, not dtrain.common).
"""

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

# Folders that are no package: Python's bytecode caches (find_namespace_packages takes any folder).
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]
# dtrain.bundle is data only: the checkout's root holds the files `dtrain up` and `dtrain build` read
# (dtrain.control.assets), and only the folders that hold them are its subpackages.
BUNDLE = ["dtrain.bundle", "dtrain.bundle.infra", "dtrain.bundle.infra.modules.plan", "dtrain.bundle.docker"]


class BuildPy(build_py):
    """dtrain.bundle's folder is the checkout's root, whose one module is this file: no part of the bundle."""

    def find_package_modules(self, package, package_dir):
        return [] if package == "dtrain.bundle" else super().find_package_modules(package, package_dir)


setup(
    packages=[
        "dtrain",  # the namespace itself (packages/ holds no module of its own), so that it maps to packages/
        "dtrain.cli",
        *(f"dtrain.{name}" for name in find_namespace_packages("packages", exclude=NOT_PACKAGES)),
        *BUNDLE,
    ],
    # dtrain.<name> is packages/<name> through the one "dtrain" entry. The editable install (setup.sh's
    # `pip install -e`) maps that whole folder, so a package added to it imports without a reinstall.
    package_dir={"dtrain": "packages", "dtrain.cli": "cli", "dtrain.bundle": "."},
    cmdclass={"build_py": BuildPy},
)
