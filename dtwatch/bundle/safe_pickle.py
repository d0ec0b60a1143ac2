"""Reading torch's Flight Recorder dumps without running code.

A dump is a pickle of plain containers and scalars (dicts, lists, tuples, strings, numbers, booleans, None).
``pickle.load`` would also build any object a crafted file names, and a pickle can name a function to call
(``__reduce__``): a file written into the run directory by the training container, then read by a watchdog
sidecar that holds ``SYS_PTRACE``, or a dump attached to a bug report, would run code in whoever opens it.
:func:`load_plain` admits the plain types only; a file that names anything else is refused with an error
naming the file and what it asked for.
"""
from __future__ import annotations

import gc
import io
import pickle
from typing import Any, BinaryIO


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that asks for more than plain containers and scalars (refused, nothing run)."""


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        # Plain containers and scalars are pickled by opcodes of their own; a global is never needed for them.
        raise UnsafePickleError(f"{self._name}: refused: the pickle asks for {module}.{name}, which a Flight Recorder "
                                "dump never contains (nothing in it was run)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._name}: refused: the pickle asks for a persistent object")


def load_plain(data: bytes | BinaryIO, name: str = "<bytes>") -> Any:
    """Unpickle ``data`` (bytes or a binary file) admitting only plain containers and scalars."""
    # A buffered reader lets the unpickler read ahead (torch writes protocol 2, which has no frames: from a bare
    # BytesIO it reads opcode by opcode, 3x slower); the collector is held off while a dump's many small dicts
    # are built.
    file = io.BufferedReader(io.BytesIO(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _PlainUnpickler(file, name).load()
    finally:
        if collecting:
            gc.enable()


__all__ = ["UnsafePickleError", "load_plain"]
