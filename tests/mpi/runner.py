"""Run one test body on every rank: `mpiexec -n N python tests/mpi/runner.py BODY 'JSON-KWARGS'`.

BODY is a function of tests/mpi/bodies.py, or `module:function` for another module of tests/mpi/
(e.g. `strategy_bodies:all_strategies_agree`).

Each rank prints `BURSTCU-RESULT <rank> <json>` when its body returns. An exception on any rank
prints its traceback and aborts the whole world (MPI_Abort), so no rank waits forever for a
peer that died; pytest then sees a non-zero exit (and has its own timeout as a last resort).
Bodies live in tests/mpi/ (bodies.py and the *_bodies.py modules) and must pass at any world size.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402


def main() -> None:
    name, kwargs = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        import importlib
        module, _, func = name.rpartition(":")
        bodies = importlib.import_module(f"tests.mpi.{module or 'bodies'}")
        result = getattr(bodies, func)(**kwargs)
    except BaseException:
        sys.stdout.write(f"BURSTCU-FAIL {rank}\n{traceback.format_exc()}\n")
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
        return
    sys.stdout.write(f"BURSTCU-RESULT {rank} {json.dumps(result)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
