"""`python -m minispeed.engine.config schema|reference`: the JSON Schema of the whole ds_config,
or the config reference page rendered from it (`--out FILE` writes it atomically)."""

from __future__ import annotations

import argparse
import json
import sys

from minispeed.core.files import atomic_write, make_parent


def main(argv: list[str] | None = None) -> int:
    """`python -m minispeed.engine.config schema|reference`: print the JSON Schema of the whole
    ds_config, or the config reference page rendered from it."""
    parser = argparse.ArgumentParser(prog="python -m minispeed.engine.config")
    parser.add_argument("what", choices=("schema", "reference"))
    parser.add_argument(
        "--out", help="write to this file (atomically; its folder is created) instead of stdout"
    )
    args = parser.parse_args(argv)
    from minispeed.engine.config.schema import config_schema, reference_markdown

    text = (
        json.dumps(config_schema(), indent=2) + "\n"
        if args.what == "schema"
        else reference_markdown()
    )
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        atomic_write(make_parent(args.out), text)
    except OSError as e:
        print(f"{parser.prog} {args.what}: --out: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
