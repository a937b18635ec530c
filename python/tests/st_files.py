"""safetensors files made by hand, in the format's own layout, for the tests."""
import json
import pathlib
import struct

import numpy as np

NAMES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64", np.dtype("uint8"): "U8",
         np.dtype("int32"): "I32", np.dtype("bool"): "BOOL", np.dtype("float64"): "F64", np.dtype("int16"): "I16"}


def header_file(path, header, data=b"", pad=True):
    """A file of `header` (dict, or raw bytes) followed by `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def write_numpy(path, arrays, metadata=None):
    header, offset, blobs = {}, 0, []
    for k, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata is not None:
        header["__metadata__"] = metadata
    return header_file(path, header, b"".join(blobs))
