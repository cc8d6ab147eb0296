"""``python3 -m kvpersist.cli`` is ``kvp-admin``."""

from . import main

raise SystemExit(main())
