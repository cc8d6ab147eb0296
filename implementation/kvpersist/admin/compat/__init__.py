"""Would kvpersist keep its features on with this vLLM and this LMCache?  Answered from their
source files alone: no GPU, and neither package is imported, so a wheel of another build (CUDA,
ROCm) or a source checkout is checked on any host.

kvpersist depends on the two packages in three ways, and :func:`check` reads all three:

1. **The fence's pins** (:data:`kvpersist.serving.lmcache_compat.pins.FEATURES`): each pinned
   function's source is cut out of its file as ``inspect.getsource`` would give it for the
   undecorated function (decorator lines included, a method's indentation kept) and digested
   as :func:`~kvpersist.serving.lmcache_compat.pins.source_digest` does.  A feature with a
   changed or missing function is off; an ``unsafe_without`` one closes the gate.
2. **vLLM's engine configuration** (:func:`~kvpersist.serving.lmcache_compat.engine_config.
   engine_field_names`): ``VllmConfig``'s dataclass fields, one level into each sub-config
   dataclass, plus :data:`~kvpersist.serving.lmcache_compat.engine_config.NESTED`.  A field
   :data:`~kvpersist.identity.engine_fields.ENGINE_FIELDS` does not classify closes the gate;
   an entry the target no longer has is reported as stale.
3. **The connector's API surface**: every ``vllm``/``lmcache`` import of kvpersist's own code
   (``testing/`` excepted) and every ``vllm`` import of LMCache's vLLM integration modules must
   resolve in the target trees; vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` are compared
   with :data:`TESTED_CONNECTOR_SURFACE`, recorded from vLLM 0.32.0, and with how
   ``kv_connector.py`` forwards (instance methods and properties forwarded to ``inner``
   automatically, class and static methods only where ``KvPersistConnector`` defines them).

Modules, each with one job (the order is the order of their imports):

* :mod:`.parsing` — one module's source: its run-time bindings, class members, decorators;
* :mod:`.import_uses` — which imports a module makes and when each runs;
* :mod:`.sources` — locating and reading a distribution (folder, wheel, installed):
  :class:`SourceTree`;
* :mod:`.resolve` — names resolved across modules and distributions: :class:`SourceTrees`;
* :mod:`.pins_check` — 1. the fence's pins: :class:`FeatureResult`;
* :mod:`.engine_fields_check` — 2. the engine configuration: :class:`EngineFields`;
* :mod:`.connector_api` — 3. the base classes' surface: :class:`ApiFinding`,
  :data:`TESTED_CONNECTOR_SURFACE`;
* :mod:`.imports_check` — 3. the imports kvpersist and LMCache's vLLM integration make;
* :mod:`.report` — :class:`CompatReport`, :func:`check`, :func:`check_installed`.

Invariants
----------
* Nothing here imports vLLM or LMCache, at import time or in :func:`check`; the installed
  distributions are located through their metadata only.
* On the tested versions every pin digest, the field list and the connector surface equal what
  the run-time code computes (the tests prove it), so a difference reported for another
  version is a difference of that version.
* :attr:`CompatReport.exit_code` is 2 when caching would not run (the gate closes, or the
  connector would not import or instantiate), 1 when it runs with less (a feature off, an
  LMCache override bypassed), and 0 otherwise.
"""

from __future__ import annotations

from .connector_api import TESTED_CONNECTOR_SURFACE, ApiFinding, Severity, connector_surface
from .engine_fields_check import EngineFields, dataclass_fields, engine_field_names_from_source
from .import_uses import Context
from .pins_check import ChangedSource, FeatureResult, function_source, pin_digest
from .report import CompatReport, check, check_installed, trees_for
from .resolve import SourceTrees
from .sources import (
    KVPERSIST_ROOT,
    CompatError,
    DistributionInfo,
    DistributionPath,
    SourceTree,
    installed_location,
)

__all__ = [
    "KVPERSIST_ROOT",
    "TESTED_CONNECTOR_SURFACE",
    "ApiFinding",
    "ChangedSource",
    "CompatError",
    "CompatReport",
    "Context",
    "DistributionInfo",
    "DistributionPath",
    "EngineFields",
    "FeatureResult",
    "Severity",
    "SourceTree",
    "SourceTrees",
    "check",
    "check_installed",
    "connector_surface",
    "dataclass_fields",
    "engine_field_names_from_source",
    "function_source",
    "installed_location",
    "pin_digest",
    "trees_for",
]
