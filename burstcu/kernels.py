"""`python -m burstcu.kernels ...`: the older name of `python -m burstcu.build ...` (the compile
gate `check`, and `warm`), kept for the scripts that call it; the same command line."""

if __name__ == "__main__":
    import sys

    from burstcu.build.__main__ import main

    sys.exit(main())
