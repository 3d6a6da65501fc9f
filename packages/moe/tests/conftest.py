import sys
from pathlib import Path

# Tests share the tiny model in _models.py (imported by the worker processes too).
sys.path.insert(0, str(Path(__file__).parent))
