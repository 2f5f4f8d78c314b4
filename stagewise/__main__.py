"""`python -m stagewise`: the same command line as the `stagewise` console script."""

from stagewise.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
