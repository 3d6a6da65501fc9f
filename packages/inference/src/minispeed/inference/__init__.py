"""minispeed.inference — not yet implemented; see packages/inference/README.md for what is coming.

This module deliberately exports nothing: no placeholder API that would pretend to work.
"""

__all__: list[str] = []
