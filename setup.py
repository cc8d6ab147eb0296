"""Build of the optional C extension ``kvpersist.l2._walk`` (the metadata lives in pyproject.toml).

``optional=True``: without a C compiler the package still installs and ``kvpersist.l2.inventory``
falls back to its pure-Python walker (same results, about 3x slower on a million files).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpersist.l2._walk", ["implementation/kvpersist/l2/_walk.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-pthread"],
                             extra_link_args=["-pthread"], optional=True)])
