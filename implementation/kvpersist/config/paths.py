"""Where the configuration templates are: package data, so an installed wheel has them too
(``configs/generic`` in a checkout is a link to the same folder)."""

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
SITE_TEMPLATE = TEMPLATES_DIR / "kvpersist.env"
ADAPTER_TEMPLATES = TEMPLATES_DIR / "l2-adapters.json"
#: Directly under the cache root: the L2 store's own state (its index snapshot), never data.
#: Here, not in ``l2``, because the launcher keeps its start-up probe there too.
STATE_DIR_NAME = ".kvpersist-state"
