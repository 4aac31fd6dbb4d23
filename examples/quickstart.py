"""The Quickstart demo as a script: same as `unifusion demo` (see unifusion/demo.py for what it does).

    python examples/quickstart.py --train-seconds 300 --steps 16 64 --out unifusion-demo
"""

from unifusion.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
