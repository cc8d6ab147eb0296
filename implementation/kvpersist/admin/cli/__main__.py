"""``python3 -m kvpersist.admin.cli`` is ``kvp-admin``."""

from . import main

raise SystemExit(main())
