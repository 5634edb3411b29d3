"""Run one test body on every process torchrun starts: `torchrun --standalone --nproc_per_node N
tests/mpi/torchrun_runner.py BODY 'JSON-KWARGS'` (`tests.mpi_run.run_torchrun`).

BODY is `module:function` of tests/mpi/. The process joins torch.distributed over gloo first
(as a program under torchrun does), then runs the body; each process prints `BURSTCU-RESULT
<rank> <json>` when its body returns. An exception prints its traceback and exits 1, and
torchrun stops the other processes. MPI is never imported here.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
    import importlib

    import torch.distributed as dist

    name, kwargs = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo")
        module, _, func = name.rpartition(":")
        result = getattr(importlib.import_module(f"tests.mpi.{module}"), func)(**kwargs)
    except BaseException:
        sys.stdout.write(f"BURSTCU-FAIL {rank}\n{traceback.format_exc()}\n")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write(f"BURSTCU-RESULT {rank} {json.dumps(result)}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
