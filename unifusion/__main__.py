"""``python -m unifusion`` runs the command line (:mod:`unifusion.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
