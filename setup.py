"""Maps the folder tree onto one import name, ``rlsync``: libraries in libs/, one service per folder."""

from setuptools import find_packages, setup

ROOTS = {
    "rlsync": "libs/rlsync",
    "rlsync.rollout": "services/rollout",
    "rlsync.trainer": "services/trainer",
    "rlsync.coordinator": "services/coordinator",
}

packages, package_dir = [], {}
for name, path in ROOTS.items():
    package_dir[name] = path
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(path)]

setup(packages=packages, package_dir=package_dir)
