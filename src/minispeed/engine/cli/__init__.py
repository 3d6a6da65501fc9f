"""The `minispeed` command line (`main.py`) and what it runs: `launcher.py` (`minispeed run`,
with `local_rank_arg.py` in each rank's process), `sizing.py` (`minispeed estimate`),
`resolved.py` (`minispeed report --config`). `minispeed tune` is `minispeed.engine.tune`;
`consolidate` and `trace` are the packages' own command lines (`consolidate.py` first turns a
checkpoint DeepSpeed wrote into zero's layout). One page per subcommand:
docs/cli/."""

from minispeed.engine.cli.main import main

__all__ = ["main"]
