"""``python -m kvtier``: the same command line as the ``kvtier`` script."""

from kvtier.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
