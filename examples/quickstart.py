"""The Quickstart demo as a script: same as `unifusion demo` (`unifusion demo --help` says what it does).

    python examples/quickstart.py --train-seconds 300 --block-size 16 --out unifusion-demo
"""

import sys

from unifusion.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["demo", *sys.argv[1:]]))
