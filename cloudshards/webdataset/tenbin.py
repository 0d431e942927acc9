"""webdataset 1.0.2's ``webdataset.tenbin`` (its tensor binary format) is left out.

Every function raises :class:`~cloudshards.UnsupportedError`; store arrays as ``.npy`` or
``.npz`` fields instead (decoded by default, written by ``TarWriter``). The format constants
stay readable.
"""

from __future__ import annotations

from cloudshards.webdataset._unsupported import unsupported_function

__all__ = [
    "bytedata",
    "bytelen",
    "check_acceptable_input_type",
    "check_infos",
    "decode_buffer",
    "decode_chunks",
    "decode_header",
    "decode_list",
    "encode_buffer",
    "encode_chunks",
    "encode_header",
    "encode_list",
    "load",
    "long_to_short",
    "magic",
    "magic_bytes",
    "magic_str",
    "read",
    "read_chunk",
    "roundup",
    "save",
    "short_to_long",
    "str64",
    "unstr64",
    "write",
    "write_chunk",
]

_INSTEAD = "store arrays as .npy or .npz fields (TarWriter writes them, decode() reads them)"

#: dtype names of the format, as webdataset spells them.
long_to_short = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "unit32": "u4",
    "uint64": "u8",
}
short_to_long = {v: k for k, v in long_to_short.items()}
magic_str = "~TenBin~"
magic_bytes = magic_str.encode("ascii")
magic = int.from_bytes(magic_bytes, "little")

bytelen = unsupported_function("tenbin.bytelen", _INSTEAD)
bytedata = unsupported_function("tenbin.bytedata", _INSTEAD)
check_acceptable_input_type = unsupported_function("tenbin.check_acceptable_input_type", _INSTEAD)
str64 = unsupported_function("tenbin.str64", _INSTEAD)
unstr64 = unsupported_function("tenbin.unstr64", _INSTEAD)
check_infos = unsupported_function("tenbin.check_infos", _INSTEAD)
encode_header = unsupported_function("tenbin.encode_header", _INSTEAD)
decode_header = unsupported_function("tenbin.decode_header", _INSTEAD)
encode_list = unsupported_function("tenbin.encode_list", _INSTEAD)
decode_list = unsupported_function("tenbin.decode_list", _INSTEAD)
roundup = unsupported_function("tenbin.roundup", _INSTEAD)
encode_chunks = unsupported_function("tenbin.encode_chunks", _INSTEAD)
decode_chunks = unsupported_function("tenbin.decode_chunks", _INSTEAD)
encode_buffer = unsupported_function("tenbin.encode_buffer", _INSTEAD)
decode_buffer = unsupported_function("tenbin.decode_buffer", _INSTEAD)
write_chunk = unsupported_function("tenbin.write_chunk", _INSTEAD)
read_chunk = unsupported_function("tenbin.read_chunk", _INSTEAD)
write = unsupported_function("tenbin.write", _INSTEAD)
read = unsupported_function("tenbin.read", _INSTEAD)
save = unsupported_function("tenbin.save", _INSTEAD)
load = unsupported_function("tenbin.load", _INSTEAD)
