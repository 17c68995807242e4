"""A strict stand-in for CuPy, for cfp's tests on machines without a GPU. It is not part of cfp.

The test harness puts tests/standin first on PYTHONPATH (tests/run_suite.py's stand-in runs,
never where a real CuPy sees a GPU), so that cfp's own `import cupy` finds this package and its
device path is the one exercised. The numbers are NumPy's (each array wraps a NumPy array), so
results compare exactly with a NumPy run; what is checked is how cfp treats device arrays:

- an array is not a NumPy array: `np.asarray(x)`, `np.array(x)` and `__array__` raise
  TypeError, as CuPy's do; so does any NumPy function or ufunc given one (`np.sqrt(x)`,
  `np.concatenate([x])`: cfp must ask `get_array_module` for the module, never call `np.`);
- mixing one with a NumPy array in an operation raises TypeError (CuPy's rule); Python and
  NumPy scalars mix freely, as in CuPy;
- reductions give 0-d arrays, not NumPy scalars (CuPy's);
- the only transfers are `asarray`/`array` of host data, host data used as an index or as the
  value of an assignment (to the device), and `.get()`/`asnumpy` (to the host); each is counted
  with its bytes in `stats`;
- `float(x)`, `int(x)`, `bool(x)`, `x.item()` and `x.tolist()` read a value on the host: each
  counts as a sync (with its bytes as a transfer to the host);
- no `__cuda_array_interface__`, `__dlpack__` or buffer protocol: MPI cannot read one, so cfp
  must stage through host buffers.

`stats` holds the counts (`reset()`, `snapshot()`); `cuda.runtime.getDeviceCount()` is
CFP_STANDIN_DEVICES (default 1).
"""
import numbers
import os

import numpy as _np

__version__ = "0.0-standin"
__standin__ = True


class _Stats:
    """What crossed between host and 'device', and the syncs."""

    FIELDS = ("to_device", "to_device_bytes", "to_host", "to_host_bytes", "syncs", "stream_syncs")

    def __init__(self):
        self.reset()

    def reset(self):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.sync_sites = []

    def snapshot(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    def _to_device(self, nbytes):
        self.to_device += 1
        self.to_device_bytes += int(nbytes)

    def _to_host(self, nbytes):
        self.to_host += 1
        self.to_host_bytes += int(nbytes)

    def _sync(self, nbytes, what):
        self.syncs += 1
        self._to_host(nbytes)
        if len(self.sync_sites) < 100:
            import traceback
            self.sync_sites.append((what, "".join(traceback.format_stack(limit=6)[:-2])))


stats = _Stats()


def _host_nbytes(value):
    """Bytes of host data `value` (an array, a list of numbers or a scalar) once on the device."""
    return _np.asarray(value).nbytes


def _unwrap(value, what="an operation"):
    """The NumPy array behind a stand-in array (recursively through lists and tuples); a NumPy
    array here is host memory mixed with device arrays: TypeError, as in CuPy."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, _np.ndarray):
        raise TypeError(f"Unsupported type <class 'numpy.ndarray'> in {what}: a host (NumPy) array mixed with "
                        f"device arrays (cupy stand-in)")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, what) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v, what) for k, v in value.items()}
    return value


def _wrap(value):
    """Stand-in arrays for the NumPy arrays and scalars of a result (0-d arrays for scalars, as
    CuPy's reductions give)."""
    if isinstance(value, _np.ndarray):
        return ndarray._of(value)
    if isinstance(value, _np.generic) and not isinstance(value, _np.dtype):
        return ndarray._of(_np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _index(key):
    """An indexing key with stand-in arrays unwrapped; host arrays and lists in it are copied to
    the device first, as CuPy does (counted)."""
    def one(k):
        if isinstance(k, ndarray):
            return k._a
        if isinstance(k, (_np.ndarray, list)):
            stats._to_device(_host_nbytes(k))
            k = _np.asarray(k)
            return k.astype(_np.intp) if k.size == 0 else k
        return k
    return tuple(one(k) for k in key) if isinstance(key, tuple) else one(key)


def _binary(name):
    def op(self, other):
        return _wrap(getattr(self._a, name)(_unwrap(other, name)))
    op.__name__ = name
    return op


def _inplace(name):
    def op(self, other):
        getattr(self._a, name)(_unwrap(other, name))
        return self
    op.__name__ = name
    return op


def _unary(name):
    def op(self):
        return _wrap(getattr(self._a, name)())
    op.__name__ = name
    return op


# NumPy ndarray members CuPy's arrays lack, or that would hand out host memory
_HIDDEN = {"__dlpack__", "__dlpack_device__", "tobytes", "tofile", "dump", "dumps", "ctypes", "data", "__array_interface__", "__array_struct__",
           "tostring", "getfield", "setfield", "byteswap", "newbyteorder", "itemset", "resize"}


class ndarray:
    """A device array: a NumPy array that only this module's functions may touch."""

    __slots__ = ("_a",)
    __hash__ = None

    def __init__(self, shape, dtype=float, order="C"):
        self._a = _np.empty(shape, dtype, order=order)

    @classmethod
    def _of(cls, a):
        out = object.__new__(cls)
        out._a = a
        return out

    # what CuPy refuses
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly. (cupy stand-in)")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise TypeError(f"numpy.{ufunc.__name__}.{method} called on a device array (cupy stand-in): use the "
                        f"array's module (cfp.backend.get_array_module)")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} called on a device array (cupy stand-in): use the array's "
                        f"module (cfp.backend.get_array_module)")

    def __getattr__(self, name):
        if name in _HIDDEN or name.startswith("__array"):
            raise AttributeError(f"cupy stand-in ndarray has no attribute {name!r}")
        value = getattr(self._a, name)
        if callable(value):
            def method(*args, **kwargs):
                return _wrap(value(*_unwrap(args, name), **_unwrap(kwargs, name)))
            method.__name__ = name
            return method
        return _wrap(value)

    # attributes that are plain values
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))
    device = property(lambda self: cuda.Device(cuda._current))

    # the transfers and syncs
    def get(self, stream=None, order="C", out=None):
        stats._to_host(self._a.nbytes)
        host = _np.array(self._a, order=order, copy=True)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr, stream=None):
        if not isinstance(arr, _np.ndarray):
            raise TypeError("set() takes a NumPy array")
        stats._to_device(arr.nbytes)
        self._a[...] = arr

    def item(self, *args):
        stats._sync(self._a.itemsize, "item")
        return self._a.item(*args)

    def tolist(self):
        stats._sync(self._a.nbytes, "tolist")
        return self._a.tolist()

    def __float__(self):
        stats._sync(self._a.nbytes, "float")
        return float(self._a)

    def __int__(self):
        stats._sync(self._a.nbytes, "int")
        return int(self._a)

    def __index__(self):
        stats._sync(self._a.nbytes, "index")
        return self._a.__index__()

    def __bool__(self):
        stats._sync(self._a.nbytes, "bool")
        return bool(self._a)

    def __complex__(self):
        stats._sync(self._a.nbytes, "complex")
        return complex(self._a)

    def __repr__(self):
        return f"array({_np.array2string(self._a, separator=', ')}) (cupy stand-in)"

    __str__ = __repr__

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

    def __getitem__(self, key):
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key, value):
        if isinstance(value, (_np.ndarray, list)):  # host data assigned into device memory: a copy
            stats._to_device(_host_nbytes(value))
            value = _np.asarray(value)
        else:
            value = _unwrap(value, "assignment")
        self._a[_index(key)] = value

    def __copy__(self):
        return ndarray._of(self._a.copy())

    def __deepcopy__(self, memo):
        return ndarray._of(self._a.copy())

    def __reduce__(self):
        raise TypeError("cupy stand-in arrays are not pickled by cfp")


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift", "divmod"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
    setattr(ndarray, f"__r{_name}__", _binary(f"__r{_name}__"))
    if _name != "divmod":
        setattr(ndarray, f"__i{_name}__", _inplace(f"__i{_name}__"))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", _unary(f"__{_name}__"))


# ---- module functions -------------------------------------------------------------------------

def asarray(a, dtype=None, order=None, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == _np.dtype(dtype) else ndarray._of(a._a.astype(dtype))
    stats._to_device(_host_nbytes(a))
    return ndarray._of(_np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", ndmin=0, blocking=False):
    if isinstance(obj, ndarray):
        return ndarray._of(_np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    if isinstance(obj, (list, tuple)) and any(isinstance(v, ndarray) for v in obj):
        return stack([asarray(v) for v in obj]).astype(dtype) if dtype is not None else stack(list(obj))
    stats._to_device(_host_nbytes(obj))
    return ndarray._of(_np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


asanyarray = asarray


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return _np.asarray(a, order=order)


def get_array_module(*args):
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


class _Ufunc:
    """A NumPy ufunc on stand-in arrays (its methods too)."""

    def __init__(self, ufunc):
        self._u = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        return _wrap(self._u(*_unwrap(args, self.__name__), **_unwrap(kwargs, self.__name__)))

    def __getattr__(self, name):
        value = getattr(self._u, name)
        if not callable(value):
            return value

        def method(*args, **kwargs):
            return _wrap(value(*_unwrap(args, f"{self.__name__}.{name}"),
                               **_unwrap(kwargs, f"{self.__name__}.{name}")))
        return method


def _function(name, func):
    def wrapped(*args, **kwargs):
        return _wrap(func(*_unwrap(args, name), **_unwrap(kwargs, name)))
    wrapped.__name__ = name
    wrapped.__doc__ = f"numpy.{name} on stand-in arrays"
    return wrapped


# what cfp's paths need that NumPy has under other names, or that must not take host arrays
_NOT_IN_CUPY = {"asmatrix", "matrix", "load", "save", "savez", "fromfile", "loadtxt", "genfromtxt", "memmap",
                "frombuffer", "polynomial", "ma", "ctypeslib", "rec", "char", "testing"}


_SUBMODULES = {"cuda", "lib", "linalg", "random"}  # this package's own (imported below, not NumPy's)


def __getattr__(name):
    if name in _NOT_IN_CUPY or name in _SUBMODULES or name.startswith("_"):
        raise AttributeError(f"module 'cupy' (stand-in) has no attribute {name!r}")
    value = getattr(_np, name)
    if isinstance(value, _np.ufunc):
        out = _Ufunc(value)
    elif isinstance(value, type) or isinstance(value, (numbers.Number, _np.dtype)) or not callable(value):
        out = value  # dtypes, classes and constants: float32, dtype, inf, newaxis
    else:
        out = _function(name, value)
    globals()[name] = out
    return out


# dtype objects and their classes are NumPy's in CuPy too
dtype = _np.dtype
float16, float32, float64 = _np.float16, _np.float32, _np.float64
int8, int16, int32, int64, uint8, bool_ = _np.int8, _np.int16, _np.int32, _np.int64, _np.uint8, _np.bool_
inf, nan, newaxis, pi, e = _np.inf, _np.nan, _np.newaxis, _np.pi, _np.e
result_type = _function("result_type", _np.result_type)
ndim = _function("ndim", _np.ndim)


def isscalar(x):
    return _np.isscalar(x)


from . import cuda, lib  # noqa: E402  (the submodules read the names above)
from . import linalg, random  # noqa: E402,F401
