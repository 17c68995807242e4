"""cupy.cuda of the stand-in: devices, the current stream, the runtime's device count."""
import os

_current = 0


def _count():
    return int(os.environ.get("CFP_STANDIN_DEVICES", "1"))


class Device:
    def __init__(self, device=None):
        self.id = _current if device is None else int(device)
        if not 0 <= self.id < max(_count(), 1):
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id} (cupy stand-in)")

    def use(self):
        global _current
        _current = self.id

    def synchronize(self):
        from . import stats
        stats.stream_syncs += 1

    def __enter__(self):
        self._saved = _current
        self.use()
        return self

    def __exit__(self, *exc):
        Device(self._saved).use()

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __repr__(self):
        return f"<CUDA Device {self.id} (stand-in)>"


class Stream:
    def __init__(self, non_blocking=False):
        pass

    def synchronize(self):
        from . import stats
        stats.stream_syncs += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


Stream.null = Stream()


def get_current_stream():
    return Stream.null


class runtime:
    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def getDeviceCount():
        n = _count()
        if n <= 0:
            raise runtime.CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected (cupy stand-in)")
        return n

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"cfp test stand-in", "totalGlobalMem": 1 << 34}

    @staticmethod
    def runtimeGetVersion():
        return 12000


def is_available():
    return _count() > 0
