from __future__ import annotations

import sys
from pathlib import Path

# Tests run against the source tree even where the package is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementation"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
