"""`python -m minispeed.engine.cli`: the `minispeed` command."""

import sys

from minispeed.engine.cli.main import main

sys.exit(main())
