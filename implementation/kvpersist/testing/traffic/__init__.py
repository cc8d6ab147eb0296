"""Simulated traffic of many users through the real stack, and the figures a long run
watches (:mod:`.run` drives it; :mod:`.shape`, :mod:`.users`, :mod:`.ideal_lru`,
:mod:`.resources` and :mod:`.summary` each do one part)."""
