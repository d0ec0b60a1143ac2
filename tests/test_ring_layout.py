"""The ring's binary layout is a file format: every field's offset and size is pinned here.

Rings on disk and the captured incidents depend on these numbers; a field moved, resized or reordered
in ``dtwatch.ring.layout`` fails these tests. Each field is checked three ways: the offset the layout
computes, the struct the writer packs with (a value packed by name lands at that offset, with that
size) and the numpy dtype the reader views records through.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from dtwatch import ops
from dtwatch.ring import layout
from dtwatch.ring.layout import Field, Layout

# (name, offset, size) of every field, in file order. Padding fields are listed too.
RECORD_FIELDS = [
    ("stamp", 0, 8), ("seq", 8, 8), ("t_enter", 16, 8), ("t_exit", 24, 8), ("seq_span", 32, 4),
    ("status", 36, 1), ("op", 37, 1), ("dtype", 38, 1), ("ndim", 39, 1), ("flags", 40, 1), ("ntensors", 41, 1),
    ("group", 42, 2), ("site", 44, 4), ("step", 48, 8), ("numel", 56, 8), ("peer", 64, 4), ("_pad", 68, 4),
    ("dims", 72, 32), ("user_site", 104, 4), ("_reserved", 108, 12), ("stamp2", 120, 8),
]
STATIC_FIELDS = [
    ("magic", 0, 8), ("version", 8, 4), ("header_size", 12, 4), ("record_size", 16, 4), ("capacity", 20, 4),
    ("groups_off", 24, 4), ("groups_cap", 28, 4), ("sites_off", 32, 4), ("sites_cap", 36, 4),
    ("loaders_off", 40, 4), ("loaders_cap", 44, 4), ("members_off", 48, 4), ("members_cap", 52, 4),
    ("records_off", 56, 4), ("seq_clock_off", 60, 4), ("rank", 64, 4), ("local_rank", 68, 4),
    ("world_size", 72, 4), ("pid", 76, 4), ("start_time", 80, 8), ("host", 88, 64), ("job_id", 152, 128),
    ("torch_version", 280, 32), ("backend", 312, 32), ("restart_count", 344, 4), ("device_index", 348, 4),
    ("gpu_uuid", 352, 64),
]
LIVE_FIELDS = [  # offsets from LIVE_OFFSET
    ("heartbeat_time", 0, 8), ("heartbeat_count", 8, 8), ("main_site", 16, 4), ("main_top_site", 20, 4),
    ("main_site_since", 24, 8), ("step", 32, 8), ("step_time", 40, 8), ("exit_state", 48, 1),
    ("_exit_pad", 49, 3), ("exit_code", 52, 4), ("exit_time", 56, 8), ("exit_reason", 64, 256),
    ("dump_request", 320, 8), ("dump_ack", 328, 8), ("n_groups", 336, 4), ("n_sites", 340, 4),
    ("n_loaders", 344, 4), ("members_used", 348, 4), ("stack_signal", 352, 4), ("main_stack", 356, 32),
]
GROUP_FIELDS = [
    ("name", 0, 32), ("desc", 32, 32), ("size", 64, 4), ("group_rank", 68, 4), ("members_start", 72, 4),
    ("members_count", 76, 4), ("cpp_seq", 80, 8), ("cpp_seq_time", 88, 8), ("completed_seq", 96, 8),
    ("completed_time", 104, 8), ("tracked", 112, 1), ("_pad", 113, 15),
]
SITE_FIELDS = [("line", 0, 4), ("function", 4, 60), ("file", 64, 192)]
LOADER_FIELDS = [
    ("site", 0, 4), ("user_site", 4, 4), ("length", 8, 8), ("epochs", 16, 8), ("time", 24, 8), ("step", 32, 8),
    ("ident", 40, 4), ("made_site", 44, 4), ("seq_start", 48, 8), ("ended", 56, 4), ("colls", 60, 4),
]
SEQ_CLOCK_FIELDS = [("t", 0, 8), ("seq", 8, 8), ("group", 16, 2), ("_pad", 18, 6)]
FACTS_HEAD_FIELDS = [("length", 0, 4), ("crc32", 4, 4)]  # at FACTS_OFFSET, then the JSON document

LAYOUTS = {
    "record": (layout.RECORD, RECORD_FIELDS, 128),
    "static": (layout.STATIC, STATIC_FIELDS, 416),
    "live": (layout.LIVE, LIVE_FIELDS, 388),
    "group": (layout.GROUP, GROUP_FIELDS, 128),
    "site": (layout.SITE, SITE_FIELDS, 256),
    "loader": (layout.LOADER, LOADER_FIELDS, 64),
    "seq_clock": (layout.SEQ_CLOCK_LAYOUT, SEQ_CLOCK_FIELDS, 24),
    "facts_head": (layout.FACTS_HEAD, FACTS_HEAD_FIELDS, 8),
}


def marker(f: Field, index: int) -> object:
    """A value for field ``f`` whose bytes are non-zero and differ from field to field."""
    if f.type == "s":
        return bytes([0x41 + index % 26]) * f.count
    if f.type == "d":
        value: object = 1.5 + index
    else:
        value = index + 1
    return tuple(value for _ in range(f.count)) if f.is_array else value


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_field_has_its_pinned_offset_and_size(name: str) -> None:
    lay, expected, total = LAYOUTS[name]
    assert [(f.name, lay.offset(f.name), f.size) for f in lay.fields] == expected
    assert lay.size == lay.struct.size == lay.dtype.itemsize == total


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_struct_packs_each_field_at_its_offset(name: str) -> None:
    lay, expected, _ = LAYOUTS[name]
    values = {f.name: marker(f, i) for i, f in enumerate(lay.fields) if not f.is_padding}
    buf = bytearray(lay.size)
    lay.pack_into(buf, 0, **values)
    for field_name, offset, size in expected:
        f = lay.field(field_name)
        raw = bytes(buf[offset : offset + size])
        if f.is_padding:
            assert raw == bytes(size), f"{field_name}: padding must stay zero"
            continue
        unpacked = struct.unpack("<" + f.code(), raw)
        assert (unpacked if f.is_array else unpacked[0]) == values[field_name], field_name
    assert lay.unpack(buf) == values


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_numpy_dtype_agrees_with_the_struct(name: str) -> None:
    lay, expected, _ = LAYOUTS[name]
    values = {f.name: marker(f, i) for i, f in enumerate(lay.fields) if not f.is_padding}
    buf = bytearray(lay.size)
    lay.pack_into(buf, 0, **values)
    row = np.frombuffer(bytes(buf), dtype=lay.dtype)[0]
    dtype_fields = lay.dtype.fields
    assert dtype_fields is not None
    for field_name, offset, size in expected:
        dtype, dtype_offset = dtype_fields[field_name][:2]
        assert (dtype_offset, dtype.itemsize) == (offset, size), field_name
        if not lay.field(field_name).is_padding:
            value = row[field_name]
            got = tuple(value.tolist()) if lay.field(field_name).is_array else value.item()
            assert got == values[field_name], field_name


def test_header_parts_fit_where_the_format_puts_them() -> None:
    assert layout.STATIC.size <= layout.LIVE_OFFSET
    assert layout.LIVE_OFFSET + layout.LIVE.size <= layout.HEADER_SIZE
    live = {name: offset for name, offset, _ in LIVE_FIELDS}
    assert layout.OFF_HEARTBEAT == layout.LIVE_OFFSET + live["heartbeat_time"] == 512
    assert layout.OFF_MAIN_SITE == 512 + live["main_site"]
    assert layout.OFF_STEP == 512 + live["step"]
    assert layout.OFF_EXIT == 512 + live["exit_state"]
    assert layout.OFF_DUMP_REQUEST == 512 + live["dump_request"]
    assert layout.OFF_DUMP_ACK == 512 + live["dump_ack"]
    assert layout.OFF_COUNTS == 512 + live["n_groups"]
    assert layout.OFF_STACK_SIGNAL == 512 + live["stack_signal"]
    assert layout.OFF_MAIN_STACK == 512 + live["main_stack"]
    assert (layout.GROUP_CPP_OFFSET, layout.GROUP_COMPLETED_OFFSET) == (80, 96)
    assert layout.SEQ_CLOCK_BYTES == 8 + layout.SEQ_CLOCK_ENTRIES * 24
    # The setup-facts block fills the header's tail, after the live fields.
    assert layout.LIVE_OFFSET + layout.LIVE.size <= layout.FACTS_OFFSET == 1024
    assert layout.FACTS_END == layout.HEADER_SIZE
    assert layout.FACTS_CAPACITY == layout.HEADER_SIZE - 1024 - 8


def test_the_partial_structs_cover_exactly_their_fields() -> None:
    assert [s.format for s in (layout.HEARTBEAT, layout.MAIN_SITE, layout.STEP, layout.EXIT)] == [
        "<dQ", "<IId", "<Qd", "<B3xid256s"]
    assert [s.format for s in (layout.COUNTS, layout.MAIN_STACK, layout.GROUP_CPP_SEQ, layout.GROUP_COMPLETED)] == [
        "<IIII", "<8I", "<Qd", "<QdB"]
    assert (layout.RECORD_EXIT_OFFSET, layout.RECORD_EXIT.format) == (24, "<dIB")


@pytest.mark.parametrize("ndim", range(5))
def test_hot_path_entry_and_exit_packs_read_back_field_by_field(ndim: int) -> None:
    """The recorder writes a record with one entry pack (exit fields left zero, ``ndim`` dims given),
    then one exit pack; the reader's dtype must see every value where the recorder put it."""
    entry = layout.RECORD_ENTRY_BY_NDIM[ndim]
    assert entry.size == layout.RECORD_SIZE
    dims = tuple(range(2, 2 + ndim))
    buf = bytearray(layout.RECORD_SIZE)
    # The recorder's argument order: stamp, seq, t_enter, op, dtype, ndim, flags, ntensors, group, site,
    # step, numel, peer, *dims, user_site, stamp2.
    entry.pack_into(buf, 0, 7, 41, 12.5, 3, 1, ndim, 32, 2, 5, 11, 9, layout.NUMEL_FROM_SHAPE, 6, *dims, 13, 7)
    row = np.frombuffer(bytes(buf), dtype=layout.RECORD_DTYPE)[0]
    assert (row["stamp"], row["seq"], row["t_enter"], row["op"], row["dtype"], row["ndim"], row["flags"]) == (
        7, 41, 12.5, 3, 1, ndim, 32)
    assert (row["ntensors"], row["group"], row["site"], row["step"], row["numel"], row["peer"]) == (
        2, 5, 11, 9, layout.NUMEL_FROM_SHAPE, 6)
    assert tuple(row["dims"]) == dims + (0,) * (4 - ndim)
    assert (row["user_site"], row["stamp2"]) == (13, 7)
    assert (row["t_exit"], row["seq_span"], row["status"]) == (0.0, 0, 0)  # in flight until the exit pack
    layout.RECORD_EXIT.pack_into(buf, layout.RECORD_EXIT_OFFSET, 14.25, 3, layout.STATUS_ERROR)
    row = np.frombuffer(bytes(buf), dtype=layout.RECORD_DTYPE)[0]
    assert (row["t_exit"], row["seq_span"], row["status"], row["op"]) == (14.25, 3, layout.STATUS_ERROR, 3)


def test_record_flags_are_distinct_bits() -> None:
    flags = [layout.FLAG_ASYNC, ops.FLAG_OBJECT, ops.FLAG_P2P, ops.FLAG_COALESCED, layout.FLAG_MARKER,
             layout.FLAG_ENQUEUED]
    assert all(f > 0 and f & (f - 1) == 0 for f in flags)
    assert len(set(flags)) == len(flags) and sum(flags) < 256  # a u1 field


# The ring's op codes (a record stores the number): never renumbered, new ops appended.
OP_CODES = [
    "unknown", "step", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base",
    "send_object_list", "recv_object_list", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "_broadcast_coalesced", "all_gather_single",
    "reduce_scatter_single",
]


def test_op_codes_are_pinned() -> None:
    assert list(ops.OPS[: len(OP_CODES)]) == OP_CODES
    assert all(ops.OP_CODES[name] == code for code, name in enumerate(ops.OPS))
    assert len(ops.OPS) < 256  # a u1 field


def test_every_recorded_op_has_a_ring_code_and_the_table_has_no_gaps() -> None:
    assert all(ops.BY_NAME[name].code is not None for name in ops.OP_KINDS)
    with pytest.raises(ValueError, match="codes"):
        ops._ops_by_code((ops.OpEntry("a", 0, None), ops.OpEntry("b", 2, None)))


def test_a_layout_rejects_a_field_named_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        Layout(Field("a", "I"), Field("a", "Q"))
