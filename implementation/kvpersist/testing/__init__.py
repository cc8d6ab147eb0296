"""Support for the test suites and the benchmarks (as ``numpy.testing`` is for numpy): the one
corruption helper, LMCache's own bench client driven from Python, the kill -9 cycles, and
helpers for servers, L2 files and pins.  Nothing in the runtime packages imports it.
"""
