"""python launch/mpi_first.py [-rc KEY=VALUE,...] PROGRAM [ARGS...]: `python -m mpi4py PROGRAM
...`, with MPI initialised before PROGRAM runs (PROGRAM: a script, `-m module`, `-c code` or
`-`, as for `python -m mpi4py`; its `-rc` options are applied before MPI starts, as there).

Why: `-m mpi4py` aborts every rank on an uncaught exception only once MPI has been initialised
(on importing mpi4py.MPI). A rank that raises before that leaves the others in MPI_Init forever.
With MPI initialised first, any exception, anywhere in the program, ends the whole job.
launch/burstcu-run starts every rank through this file. (mpi4py.rc settings a program makes
itself come too late here: pass them as -rc options.)

Under launch/rank-guard it also writes the program's state to $BURSTCU_PROGRAM_STATE: "running"
once MPI has started, "exit" once MPI is finalized or the interpreter exits. A rank whose file
still says "running" left without either (os._exit, a C library's exit()), and rank-guard fails
the job.
"""

import atexit
import os
import sys
from ast import literal_eval

PROGRAM_STATE = "BURSTCU_PROGRAM_STATE"


def rc_options(args: list) -> dict:
    """mpi4py's `-rc KEY=VALUE,...` (or `--rc=...`) options at the head of `args`, as mpi4py
    parses them (values through literal_eval where they are literals)."""
    found, i = {}, 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c", "-"):
        if args[i] in ("-rc", "--rc") and i + 1 < len(args):
            entries, i = args[i + 1], i + 2
        elif args[i].startswith("--rc="):
            entries, i = args[i].partition("=")[2], i + 1
        else:
            i += 1
            continue
        for entry in entries.split(","):
            key, _, value = entry.partition("=")
            try:
                found[key] = literal_eval(value)
            except (ValueError, SyntaxError):
                found[key] = value
    return found


def mark_running(path: str | None) -> None:
    """Write "running" to `path` now and "exit" when MPI is finalized (the program's own
    MPI.Finalize(), or mpi4py's at the interpreter's exit: MPI_Finalize deletes COMM_SELF's
    attributes first, which runs the hook set here) or at the interpreter's exit, from this
    process only (a forked child's exit does not count); None: write nothing."""
    if not path:
        return
    pid = os.getpid()

    def write(word: str) -> None:
        if os.getpid() != pid:
            return
        try:
            with open(path, "w") as f:
                f.write(word + "\n")
        except OSError:
            pass   # rank-guard's folder is gone: nobody is left to read it

    write("running")
    atexit.register(write, "exit")
    from mpi4py import MPI
    finalized = MPI.Comm.Create_keyval(delete_fn=lambda *_: write("exit"))
    MPI.COMM_SELF.Set_attr(finalized, True)


def working_folder_first() -> None:
    """sys.path[0] the working folder, as `python -m` has it (mpi4py's main puts a script's own
    folder there), unless -P or -I asked for none (-P and sys.flags.safe_path: Python 3.11 on)."""
    if not (getattr(sys.flags, "safe_path", 0) or sys.flags.isolated):
        sys.path[0] = os.getcwd()


if __name__ == "__main__":
    import mpi4py

    mpi4py.rc(**rc_options(sys.argv[1:]))
    from mpi4py import MPI  # noqa: F401  (importing it initialises MPI: the point of this file)
    from mpi4py.run import main

    mark_running(os.environ.pop(PROGRAM_STATE, None))

    working_folder_first()
    main()
