"""Arrays from any framework: which device an array lives on (DLPack), the one-process group
for it, zero-copy views into the backend's arrays and results handed back in the caller's
framework, the check that inputs sit on the device the op computes on, and CUDA streams other
libraries created.

Works on NumPy and CuPy arrays and on anything that speaks DLPack (torch, JAX, ...); nothing
here imports a framework that the caller has not imported.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from .cpu_tensors import resolved
from .group import Group, local_group
from .transport.torch_dist import torch_process_group
from .validate import FLOAT_DTYPES, InputError

_DL_CUDA = 2  # DLDeviceType kDLCUDA (kDLCPU is 1)


def is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def _dlpack_device(x) -> tuple[int, int] | None:
    """(DLPack device type, device id) that x reports through `__dlpack_device__`, else None."""
    report = getattr(x, "__dlpack_device__", None)
    if not callable(report):
        return None
    try:
        kind, device_id = report()
        return int(kind), int(device_id)
    except Exception:  # noqa: BLE001 - an array that cannot say is left to validation
        return None


def cuda_device(x) -> int | None:
    """The CUDA device id x lives on (CuPy arrays; DLPack arrays on kDLCUDA), else None."""
    if is_cupy(x):
        return int(x.device.id)
    where = _dlpack_device(x)
    return where[1] if where is not None and where[0] == _DL_CUDA else None


def group_for(group: Group | None, q) -> Group:
    """`group`, or with None the one-process group for q's device: CuPy arrays and DLPack arrays
    on a CUDA device (torch, JAX, ...) -> "cupy"; everything else -> "numpy". Raises ValueError
    when q is on a GPU that CuPy cannot use in this process."""
    if group is not None:
        if torch_process_group(group):
            raise TypeError("group is a torch.distributed ProcessGroup: make burstcu's group of "
                            "its ranks once with burstcu.init(comm=that_group) and pass that")
        return group  # a closed group is refused by `Call`
    device_id = cuda_device(q)
    if device_id is None:
        return local_group("numpy")
    try:
        return local_group("cupy")
    except Exception as exc:  # noqa: BLE001 - no GPU, no CuPy, no driver: one process, no peers
        raise ValueError(
            f"q is on CUDA device {device_id}, but the 'cupy' backend cannot start in this process "
            f"({exc.__class__.__name__}: {exc}); install burstcu[cuda13] where the GPU is "
            f"visible, or pass CPU arrays") from exc


def torch_stream(tensors):
    """A context running CuPy work (kernels, copies, NCCL ordering) on torch's current stream when
    one of `tensors` is a CUDA tensor (torch imported by the caller), so it is ordered after the
    torch work that wrote them and before what torch runs next; a no-op otherwise (torch's
    default stream is CUDA's legacy stream, CuPy's default too)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    cuda = next((t for t in tensors if tensor is not None and isinstance(t, tensor) and t.is_cuda), None)
    if cuda is None:
        return contextlib.nullcontext()
    stream = torch.cuda.current_stream(cuda.device)
    if stream.cuda_stream == 0:
        return contextlib.nullcontext()
    return external_stream(stream.cuda_stream)   # the inputs' device: device_problem checks it


def external_stream(handle: int):
    """A CuPy stream object for a CUDA stream another library created (torch's current stream,
    XLA's compute stream), so CuPy work issued under it (`with ...:`) joins that stream."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:                     # CuPy before the CUDA stream protocol
        return cupy.cuda.ExternalStream(handle)

    class _Handle:                                # the CUDA stream protocol: (version, handle)
        def __cuda_stream__(self):
            return 0, handle
    return from_external(_Handle())


def device_problem(ops, names: tuple, arrays: tuple) -> InputError | None:
    """When `ops` computes on a GPU: CuPy's current device other than the op's own
    (`LocalOps.device_id`), or the first input that lives on a GPU other than the current one
    (the kernels and NCCL run there); when it computes on the host, the first input that lives
    on a GPU; as a deferred error, else None."""
    current = ops.current_device()
    if current is None:
        on_gpu = next(((name, cuda_device(x)) for name, x in zip(names, arrays)
                       if cuda_device(x) is not None), None)
        return None if on_gpu is None else InputError(ValueError, (
            f"{on_gpu[0]} is on CUDA device {on_gpu[1]} but this group computes on the host "
            f"({ops.name}): make the group with burstcu.init(backend='cupy') (or pass group=None "
            f"for one process), or pass host arrays"))
    home = ops.device_id
    if home is not None and current != home:
        return InputError(ValueError, (
            f"this group computes on CUDA device {home} (it was made there: its kernels, buffers "
            f"and NCCL communicator live there) but the current CuPy device is {current}: call "
            f"cupy.cuda.Device({home}).use() before the call, or make a group on device {current}"
            f" (with group=None, burstcu keeps one a device)"))
    for name, x in zip(names, arrays):
        device_id = cuda_device(x)
        if device_id is not None and device_id != current:
            return InputError(ValueError, (
                f"{name} is on CUDA device {device_id} but the current CuPy device is {current}: "
                f"call cupy.cuda.Device({device_id}).use() before burstcu (with group=None), or "
                f"move the inputs to device {current}"))
    return None


# frameworks whose array type lives in another package than their `from_dlpack`
# (jax.Array's class is defined in jaxlib)
_FRAMEWORK_OF = {"jaxlib": "jax"}


def is_jax(x) -> bool:
    """Whether x is a JAX array (its class lives in jaxlib or jax)."""
    return _FRAMEWORK_OF.get(type(x).__module__.split(".")[0]) == "jax"


def wait_computed(arrays) -> None:
    """Wait until the JAX arrays among `arrays` are computed, before a call takes its group
    (`Call`): `jax.jit` returns before its program has run, and the program may still hold
    burstcu calls (`burstcu.jax`'s callbacks, on XLA's threads) that need the group this call
    would hold while it waited for their result, which ends the job (another thread's call).
    Other arrays, and JAX arrays computed already, cost nothing (on a GPU, one still being
    computed costs a host wait where DLPack would have made the stream wait); a program that
    failed raises where the call reads the array, as before."""
    for x in arrays:
        if is_jax(x):
            try:
                if not x.is_deleted():        # (is_ready() of a deleted array ends the process)
                    x.block_until_ready()
            except Exception:  # noqa: BLE001 - a donated array, a failed program: the call says
                pass


def _exporter(x):
    """The `from_dlpack` of x's framework (jax.numpy, torch, ...), to hand results back in it:
    its array-API namespace's where it has one, else its package's (JAX's: `to_jax`); None
    when it cannot be found (the results then stay the backend's own arrays)."""
    if is_jax(x):
        return to_jax
    namespace = getattr(x, "__array_namespace__", None)
    try:
        fn = getattr(namespace(), "from_dlpack", None) if callable(namespace) else None
    except Exception:  # noqa: BLE001 - a namespace that cannot be had: look up the package
        fn = None
    if callable(fn):
        return fn
    package = type(x).__module__.split(".")[0]
    for name in (_FRAMEWORK_OF.get(package), package):
        root = sys.modules.get(name) if name else None
        for owner in (root, getattr(root, "numpy", None)):
            fn = getattr(owner, "from_dlpack", None)
            if callable(fn):
                return fn
    return None


def to_jax(result):
    """A result handed back to JAX: a host (NumPy) result copied into memory JAX owns, a device
    result zero-copy through DLPack. Jax arrays over NumPy's memory (`jax.numpy.from_dlpack`;
    `jax.device_put` and, on older JAX, `jnp.asarray` alias it too) made jaxlib's CPU client hang
    now and then as Python exited (docs/troubleshooting.md)."""
    import jax

    if isinstance(result, np.ndarray):
        return jax.numpy.array(result, copy=True)
    return jax.numpy.from_dlpack(result)


def native(ops, *arrays):
    """Arrays of another framework (JAX, PyTorch, ...) viewed zero-copy through DLPack as the
    backend's own arrays (a torch tensor's lazy negation or conjugation applied first:
    `cpu_tensors.resolved`), plus how to return results in the first one's framework (None: they
    already are native). Anything else is left for validation to reject with a clear error."""
    is_foreign = [not isinstance(x, ops.array_types) and hasattr(x, "__dlpack__") for x in arrays]
    if not any(is_foreign):
        return arrays, None
    converted = tuple(ops.xp.from_dlpack(resolved(x)) if f else x for x, f in zip(arrays, is_foreign))
    return converted, _exporter(arrays[is_foreign.index(True)])


def returned(export, results):
    return results if export is None else tuple(export(r) for r in results)


def untakeable(exc: Exception, arrays: tuple,
               bfloat16_advice: str = "use burstcu.torch / burstcu.jax, or NumPy arrays of "
                                      "ml_dtypes.bfloat16",
               dtype_advice: str = f"burstcu takes {', '.join(FLOAT_DTYPES)}: cast them first"
               ) -> InputError:
    """Why inputs could not be taken as the backend's arrays, with what to do instead: JAX
    tracers (jax.jit/grad/vmap), torch tensors traced by torch.compile, tensors requiring grad,
    bfloat16 over DLPack into NumPy (then `bfloat16_advice`). The kind is a builtin TypeError or
    ValueError (a framework's own exception class may not take a message: JAX's tracer errors
    want the tracer)."""
    kind = ValueError if isinstance(exc, ValueError) and not isinstance(exc, TypeError) else TypeError
    jax = sys.modules.get("jax")
    text = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
    if isinstance(exc, MemoryError):
        return InputError(MemoryError, f"out of memory while taking the inputs ({text})")
    if jax is not None and any(isinstance(x, jax.core.Tracer) for x in arrays):
        return InputError(TypeError, "got JAX tracers (inside jax.jit, jax.grad or jax.vmap): use "
                                     "burstcu.jax.attention / linear_attention / decode, which "
                                     "are differentiable and run under jax.jit")
    if type(exc).__module__.startswith("torch._") and "fake tensor" in text.lower():
        return InputError(TypeError, f"got torch tensors traced by torch.compile ({text}): use "
                                     f"burstcu.torch.attention / linear_attention / decode, which "
                                     f"run eagerly under torch.compile")
    if "require" in text and "grad" in text:
        return InputError(TypeError, f"cannot take tensors that require grad ({text}): use "
                                     f"burstcu.torch.attention / linear_attention / decode, "
                                     f"which take them, or pass .detach()")
    if "dtype" in text.lower() and any("bfloat16" in str(getattr(x, "dtype", "")) for x in arrays):
        return InputError(TypeError, f"bfloat16 arrays cannot cross DLPack into NumPy ({text}): "
                                     f"{bfloat16_advice}")
    odd = [name for name in (str(getattr(x, "dtype", "")).replace("torch.", "") for x in arrays)
           if name.startswith(("float", "complex")) and name not in FLOAT_DTYPES]
    if odd:   # float8 tensors, which DLPack may not carry
        return InputError(TypeError, f"cannot take arrays of dtype {odd[0]} ({text}): {dtype_advice}")
    return InputError(kind, f"cannot take these inputs: {text}")


def joined(x, pieces: list, axis: int):
    """The pieces of x joined along axis into one contiguous array of x's own framework: NumPy,
    CuPy, array-API arrays (JAX, ...) through their namespace's `concat`, torch tensors through
    `torch.cat`."""
    if isinstance(x, np.ndarray) or is_cupy(x):
        xp = array_module(x)
        return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))
    namespace = getattr(x, "__array_namespace__", None)
    if callable(namespace):
        return namespace().concat(pieces, axis=axis)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.cat(pieces, dim=axis).contiguous()
    return np.ascontiguousarray(np.concatenate(pieces, axis=axis))


def array_module(x):
    if is_cupy(x):
        import cupy
        return cupy
    return np
