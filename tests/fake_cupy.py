"""A stand-in for CuPy on a machine without a GPU, recording every device query and every device
switch: what the bootstrap, the kernel table choice and the API's device checks ask CuPy."""

from __future__ import annotations

import sys
import types


class FakeCupy:
    """Just enough of cupy for the bootstrap, KernelOps' device queries and `arrays.device_problem`.

    cc: the compute capability every device reports (and 132 SMs); n_devices: how many there
    are; current: the device CuPy calls current (`select` changes it). `calls` records ("attr",
    attribute, device), ("Device", id), ("use", id), ("enter", id), ("switch", id) (a Device
    property that switches in real CuPy) and ("NcclCommunicator",).
    """

    def __init__(self, cc=(9, 0), n_devices=4, current=0):
        self.calls: list = []
        self.current = current
        calls, values = self.calls, {16: 132, 75: cc[0], 76: cc[1], 97: 232448}
        fake = self

        class Device:
            def __init__(self, device_id=None):
                self.id = fake.current if device_id is None else device_id
                calls.append(("Device", self.id))

            def use(self):
                calls.append(("use", self.id))

            def __enter__(self):
                calls.append(("enter", self.id))
                return self

            def __exit__(self, *exc):
                return False

            @property
            def compute_capability(self):
                calls.append(("switch", self.id))
                return f"{cc[0]}{cc[1]}"

            @property
            def attributes(self):
                calls.append(("switch", self.id))
                return {"MaxSharedMemoryPerBlockOptin": values[97]}

        def device_attribute(attr, device_id):
            calls.append(("attr", attr, device_id))
            return values[attr]

        def pci_bus_id(device_id):
            calls.append(("pci", device_id))
            return f"0000:{0x1B + device_id:02X}:00.0"

        class Communicator:
            def __init__(self, size, uid, rank):
                calls.append(("NcclCommunicator",))

            def destroy(self):
                pass

        self.module = types.ModuleType("cupy")
        self.module.ndarray = type("ndarray", (), {})   # no array of it is ever made
        cuda = self.module.cuda = types.ModuleType("cupy.cuda")
        cuda.Device = Device
        cuda.runtime = types.SimpleNamespace(deviceGetAttribute=device_attribute,
                                             deviceGetPCIBusId=pci_bus_id,
                                             getDevice=lambda: fake.current,
                                             getDeviceCount=lambda: n_devices)
        cuda.Stream = lambda **kwargs: object()
        cuda.Event = lambda **kwargs: object()
        cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)   # the legacy stream
        cuda.nccl = types.ModuleType("cupy.cuda.nccl")
        cuda.nccl.get_unique_id = lambda: b"\0" * 128
        cuda.nccl.NcclCommunicator = Communicator

    def install(self, monkeypatch):
        """Put this cupy in sys.modules for the test (undone at its end); returns self."""
        for name, module in (("cupy", self.module), ("cupy.cuda", self.module.cuda),
                             ("cupy.cuda.nccl", self.module.cuda.nccl)):
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def select(self, device_id: int) -> None:
        """Make `device_id` CuPy's current device (as `cupy.cuda.Device(device_id).use()` does
        in real CuPy; here `use` only records)."""
        self.current = device_id

    def switches(self):
        """The recorded calls that make a device current."""
        return [c for c in self.calls if c[0] in ("use", "enter", "switch")]
