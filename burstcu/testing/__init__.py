"""Verification code, like `numpy.testing`: nothing in the library's run path imports it (the
"emulated" backend's build lives beside the NVRTC one, in `burstcu.build.emulate`).

* `reference`: float64 attention written plainly (full score matrix, explicit softmax) and the
  FlashAttention tolerance rule; `host_arrays`: a device LocalOps seen through NumPy arrays, so
  one test body checks the CUDA kernels under the CPU emulator and on a GPU (both import only
  the layers below the engine);
* `world`: `run_ranks`, G ranks of the real engine as threads on one device, and `checks`:
  everything `python -m burstcu.selftest --full` verifies. These two drive the public API, so
  they sit above it; still, nothing below them imports them;
* `schedule`: the GPU ordering checker (records the stream/event/NCCL actions of the real engine
  and proves happens-before).
"""
