"""The `llamax` command line."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamax", description="llama.cpp's KV-cache runtime for Python")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="a short tour of the KV cache with a tiny random model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    if args.cmd == "demo":
        from llamax.demo import run
        run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
