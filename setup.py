"""Build of the optional C extensions (the metadata lives in pyproject.toml):

- ``kvpersist.l2._walk``: the inventory walk; without it ``kvpersist.l2.inventory`` falls back to
  its pure-Python walker (same results, about 3x slower on a million files);
- ``kvpersist.l2._readloop``: a file's payload read with the GIL released once; without it
  ``kvpersist.l2.read_loop`` falls back to its Python loops (same results, one GIL round trip
  per segment).

``optional=True``: without a C compiler the package still installs.
"""

import platform

from setuptools import Extension, setup

#: xxHash's runtime CPU dispatch (AVX2/AVX-512 kernels) is x86-64 code; elsewhere the portable one.
DISPATCH = (["implementation/kvpersist/l2/_vendor/xxhash/xxh_x86dispatch.c"]
            if platform.machine() in ("x86_64", "AMD64") else [])

setup(ext_modules=[Extension("kvpersist.l2._walk", ["implementation/kvpersist/l2/_walk.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-pthread"],
                             extra_link_args=["-pthread"], optional=True),
                   Extension("kvpersist.l2._readloop",
                             ["implementation/kvpersist/l2/_readloop.c", *DISPATCH],
                             extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True)])
