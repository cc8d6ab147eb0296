"""Build of the optional C extensions (the metadata lives in pyproject.toml):

- ``kvpersist.l2._walk``: the inventory walk; without it ``kvpersist.l2.inventory`` falls back to
  its pure-Python walker (same results, about 3x slower on a million files);
- ``kvpersist.l2._readloop``: a file's payload read with the GIL released once; without it
  ``kvpersist.l2.read_counter`` falls back to its Python loop (same results, one GIL round trip
  per segment).

``optional=True``: without a C compiler the package still installs.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpersist.l2._walk", ["implementation/kvpersist/l2/_walk.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-pthread"],
                             extra_link_args=["-pthread"], optional=True),
                   Extension("kvpersist.l2._readloop", ["implementation/kvpersist/l2/_readloop.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True)])
