"""The report: the three checks run against a vLLM and an LMCache distribution, and the verdict.

Invariants
----------
* :attr:`CompatReport.exit_code` is 2 when caching would not run (the gate closes, or the
  connector would not import or instantiate), 1 when it runs with less (a feature off, an
  LMCache override bypassed), and 0 otherwise.
* :func:`check` closes every tree it opened, also when a check raises.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...serving.lmcache_compat import pins as lmcache_pins
from .connector_api import ApiFinding, _check_surface
from .engine_fields_check import EngineFields, _check_engine_fields
from .imports_check import _check_imports
from .pins_check import FeatureResult, _check_features
from .resolve import SourceTrees
from .sources import DistributionInfo, DistributionPath, SourceTree, installed_location


@dataclass(frozen=True)
class CompatReport:
    """What kvpersist would do with these vLLM and LMCache distributions.

    Invariants: ``gate_reasons`` lists exactly what closes the connector's gate at run time
    (each ``unsafe_without`` feature that is off, and unclassified engine fields);
    ``breaking`` the API findings that keep the connector from loading or working; a feature is
    on exactly when all its pinned sources match.
    """

    vllm: DistributionInfo
    lmcache: DistributionInfo
    features: tuple[FeatureResult, ...]
    engine_fields: EngineFields
    api: tuple[ApiFinding, ...]

    @property
    def gate_reasons(self) -> tuple[str, ...]:
        reasons = [f"fence feature {f.name} is off ({f.if_off})" for f in self.features
                   if f.unsafe_without and not f.on]
        unknown = self.engine_fields.unknown
        if unknown:
            reasons.append(f"{len(unknown)} engine field(s) kvpersist never classified: "
                           + ", ".join(unknown))
        if self.engine_fields.unresolved:
            reasons.append("engine configuration not readable: "
                           + ", ".join(self.engine_fields.unresolved))
        return tuple(reasons)

    @property
    def gate_closes(self) -> bool:
        return bool(self.gate_reasons)

    @property
    def breaking(self) -> tuple[ApiFinding, ...]:
        return tuple(f for f in self.api if f.severity == "breaks")

    @property
    def features_off(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features if not f.on)

    @property
    def exit_code(self) -> int:
        """2: caching would not run (gate closes, or the connector breaks); 1: it runs with a
        feature off or an API difference that degrades it; 0: everything on."""
        if self.gate_closes or self.breaking:
            return 2
        if self.features_off or any(f.severity == "degrades" for f in self.api):
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(gate_closes=self.gate_closes, gate_reasons=list(self.gate_reasons),
                    features_off=list(self.features_off), exit_code=self.exit_code,
                    tested_versions=dict(lmcache_pins.TESTED_VERSIONS))
        return data

    def lines(self) -> Iterator[str]:
        """The report as text, most important first."""
        verdict = {0: "OK: every feature on, the gate stays open",
                   1: "DEGRADED: caching runs, with less",
                   2: "CLOSED: caching would not run"}[self.exit_code]
        yield f"compat: {verdict}"
        for dist in (self.vllm, self.lmcache):
            tested = lmcache_pins.TESTED_VERSIONS.get(dist.package)
            yield (f"  {dist.package} {dist.version or '(version unknown)'} at {dist.location}"
                   + ("" if dist.version == tested else f" (tested: {tested})"))
        if not self.gate_reasons:
            yield "  gate: stays open"
        for reason in self.gate_reasons:
            yield f"  gate closes: {reason}"
        for finding in self.breaking:
            yield f"  breaks: {finding.name}: {finding.detail}"
        yield ""
        yield "fence features:"
        for f in self.features:
            state = "on" if f.on else "OFF" + (" (closes the gate)" if f.unsafe_without else "")
            yield f"  {f.name:16} {state}"
            for c in f.changed:
                yield f"      changed: {c.module}.{c.qualname} (pinned {c.pinned}, found {c.found})"
            if not f.on:
                yield f"      without it: {f.if_off}"
        yield ""
        ef = self.engine_fields
        yield (f"engine fields: {ef.count} read, {len(ef.unknown)} unknown, {len(ef.stale)} "
               "stale")
        for name in ef.unknown:
            yield f"  unknown (closes the gate): {name}"
        for name in ef.stale:
            yield f"  stale (no longer in vLLM): {name}"
        for name in ef.unresolved:
            yield f"  unreadable: {name}"
        yield ""
        yield f"connector API: {len(self.api)} finding(s)"
        for finding in sorted(self.api, key=lambda f: ("breaks", "degrades", "info").index(
                f.severity)):
            yield f"  [{finding.severity}] {finding.kind} {finding.name}: {finding.detail}"


def check(vllm: DistributionPath | None = None, lmcache: DistributionPath | None = None
          ) -> CompatReport:
    """Check kvpersist against a vLLM and an LMCache distribution (default: the installed
    ones).  Raises :class:`CompatError` when a distribution cannot be read."""
    trees = trees_for(vllm, lmcache)
    try:
        vllm_tree, lmcache_tree = trees.by_package["vllm"], trees.by_package["lmcache"]
        api = [*_check_imports(trees, lmcache_tree), *_check_surface(trees)]
        return CompatReport(vllm_tree.info, lmcache_tree.info, _check_features(trees),
                            _check_engine_fields(trees), tuple(api))
    finally:
        trees.close()


@functools.cache
def check_installed() -> CompatReport:
    """:func:`check` for the installed versions, once per process (for preflight)."""
    return check()


def trees_for(vllm: DistributionPath | None = None, lmcache: DistributionPath | None = None
              ) -> SourceTrees:
    """The parsed trees :func:`check` reads (for tests and tools that look closer)."""
    vllm_tree = SourceTree("vllm", vllm if vllm is not None else installed_location("vllm"))
    try:
        lmcache_tree = SourceTree("lmcache", lmcache if lmcache is not None
                                  else installed_location("lmcache"))
    except BaseException:
        vllm_tree.close()
        raise
    return SourceTrees(vllm_tree, lmcache_tree)
