"""A small ctypes driver for one ``libnccl.so.2``: communicator set-up and the three collectives
DDP issues, on CUDA buffers given by address (torch tensors' ``data_ptr``).

Why not torch's own NCCL process group: torch is built against one NCCL release and calls APIs
of that release (registration, window and shrink calls of 2.19-2.28), so another release put in
front of it with LD_PRELOAD may lack symbols torch binds. The five calls used here exist, with
these signatures, in every release from 2.12 to 2.32, so any ``libnccl.so.2`` loads, in its own
namespace (RTLD_LOCAL), beside the one torch may have loaded.

Facts (src/nccl.h.in, v2.18.6-1 and v2.30.7-1): ``ncclUniqueId`` is 128 bytes passed by value;
data type codes int8 0, uint8 1, int32 2, uint32 3, int64 4, uint64 5, float16 6, float32 7,
float64 8, bfloat16 9; ``ncclSum`` 0; the version code is X*10000 + Y*100 + Z from 2.9 on.
"""

from __future__ import annotations

import ctypes
import os

UNIQUE_ID_BYTES = 128
SUM = 0
DATA_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}


class NcclError(RuntimeError):
    """A call into the library failed; the message names the library, the call and NCCL's reason."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]  # bytes, NULs included (not c_char: a string)


def version_text(code: int) -> str:
    """"2.18.6" from NCCL's version code (X*1000+Y*100+Z before 2.9)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


class Library:
    """``path``: a ``libnccl.so.2`` (an unpacked nvidia-nccl-cu12/cu13 wheel's
    ``nvidia/nccl/lib/libnccl.so.2``, or a build's ``build/lib``)."""

    _CALLS = {  # name: (argument types); every call returns ncclResult_t (int)
        "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
        "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int],
        "ncclAllReduce": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_void_p],
        "ncclBroadcast": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_void_p],
        "ncclAllGather": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                          ctypes.c_void_p],
        "ncclCommDestroy": [ctypes.c_void_p],
    }

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise NcclError(f"{self.path}: no such NCCL library (give --nccl-lib PATH/libnccl.so.2)")
        try:
            self.lib = ctypes.CDLL(self.path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError as e:
            raise NcclError(f"{self.path}: cannot be loaded: {e}") from None
        for name, args in self._CALLS.items():
            try:
                fn = getattr(self.lib, name)
            except AttributeError:
                raise NcclError(f"{self.path}: not an NCCL library (no {name})") from None
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib.ncclGetErrorString.argtypes, self.lib.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        code = ctypes.c_int()
        self._check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(code)))
        self.version_code = code.value
        self.version = version_text(code.value)

    def _check(self, call: str, result: int, comm=None) -> None:
        if result == 0:
            return
        why = self.lib.ncclGetErrorString(result).decode(errors="replace")
        last = getattr(self.lib, "ncclGetLastError", None)  # 2.13+
        if last is not None:
            last.argtypes, last.restype = [ctypes.c_void_p], ctypes.c_char_p
            detail = last(comm)
            if detail:
                why += f" ({detail.decode(errors='replace')})"
        raise NcclError(f"{self.path}: {call} failed: {why} (ncclResult_t {result})")

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self._check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def communicator(self, nranks: int, uid: bytes, rank: int) -> Communicator:
        return Communicator(self, nranks, uid, rank)


class Communicator:
    """One rank's communicator. Collectives are enqueued on ``stream`` (a cudaStream_t address;
    0: the legacy default stream); the caller synchronises before it reads a result."""

    def __init__(self, lib: Library, nranks: int, uid: bytes, rank: int):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self.lib, self.nranks, self.rank = lib, nranks, rank
        self.handle = ctypes.c_void_p()
        uid_struct = UniqueId.from_buffer_copy(uid)
        lib._check("ncclCommInitRank", lib.lib.ncclCommInitRank(ctypes.byref(self.handle), nranks, uid_struct, rank))

    @staticmethod
    def _type(dtype: str) -> int:
        try:
            return DATA_TYPES[dtype]
        except KeyError:
            raise ValueError(f"NCCL has no data type {dtype!r} (known: {', '.join(DATA_TYPES)})") from None

    def all_reduce(self, buf: int, count: int, dtype: str, stream: int) -> None:
        """In place, SUM (DDP's bucket all-reduce)."""
        self.lib._check("ncclAllReduce", self.lib.lib.ncclAllReduce(buf, buf, count, self._type(dtype), SUM,
                                                                    self.handle, stream), self.handle)

    def broadcast(self, buf: int, count: int, dtype: str, root: int, stream: int) -> None:
        """In place from ``root``."""
        self.lib._check("ncclBroadcast", self.lib.lib.ncclBroadcast(buf, buf, count, self._type(dtype), root,
                                                                    self.handle, stream), self.handle)

    def all_gather(self, send: int, recv: int, count: int, dtype: str, stream: int) -> None:
        """``count`` elements from each rank into ``recv`` (nranks * count), in rank order."""
        self.lib._check("ncclAllGather", self.lib.lib.ncclAllGather(send, recv, count, self._type(dtype),
                                                                    self.handle, stream), self.handle)

    def destroy(self) -> None:
        if self.handle:
            self.lib._check("ncclCommDestroy", self.lib.lib.ncclCommDestroy(self.handle))
            self.handle = ctypes.c_void_p()
