"""Compatibility identity: everything that makes KV reusable, hashed to a namespace ``kvp-<32 hex>``.

``fields`` defines the fields, their canonical forms and the merge of two sources (fail closed);
``pins`` reads and writes ``identity.env`` files; ``sources`` derives fields from a model folder,
a live vLLM config and the installed build; ``records`` stores the identity behind each
namespace under the cache root.  Depends on :mod:`kvpersist.config` only.
"""

from .fields import (
    FIELDS,
    NAMESPACE_RE,
    CacheIdentity,
    IdentityError,
    IdentityResolution,
    diff_identities,
    merge_sources,
)
from .pins import format_pins, load_pins, parse_pins_text

__all__ = [
    "FIELDS",
    "NAMESPACE_RE",
    "CacheIdentity",
    "IdentityError",
    "IdentityResolution",
    "diff_identities",
    "format_pins",
    "load_pins",
    "merge_sources",
    "parse_pins_text",
]
