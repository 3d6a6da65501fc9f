"""Make the helper modules and scripts beside the engine tests importable in importlib mode."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
