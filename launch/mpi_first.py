"""python launch/mpi_first.py PROGRAM [ARGS...]: `python -m mpi4py PROGRAM ...`, with MPI
initialised before PROGRAM runs (PROGRAM: a script, `-m module`, `-c code` or `-`, as for
`python -m mpi4py`).

Why: `-m mpi4py` aborts every rank on an uncaught exception only once MPI has been initialised
(on importing mpi4py.MPI). A rank that raises before that leaves the others in MPI_Init forever.
With MPI initialised first, any exception, anywhere in the program, ends the whole job.
launch/burstcu-run starts every rank through this file.
"""

import os
import sys

from mpi4py import MPI  # noqa: F401  (importing it initialises MPI: the point of this file)
from mpi4py.run import main

if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it (a script's folder replaces it in main)
    main()
