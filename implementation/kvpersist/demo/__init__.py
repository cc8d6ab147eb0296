"""The CPU demo (``python -m kvpersist.demo``): the tiny model builder (``tiny_model``), the
stack driver that runs real vLLM and LMCache processes (``stack``), and the demo itself
(``__main__``).  Used by the demo, the tests and the benchmarks; nothing in the runtime
packages imports it.
"""
