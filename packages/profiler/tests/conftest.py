"""Make the helper modules beside the tests (``profiler_testlib``) importable in importlib mode."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
