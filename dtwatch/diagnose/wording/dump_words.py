"""The words of what makes a file not a Flight Recorder dump (:func:`dtwatch.diagnose.fr_states.dump_problem`),
from the fault the check found: which part of the dump, the type found there, the fields missing. Nothing here
decides; the reader of dump files (:mod:`dtwatch.report.fr_dumps`) shows the sentence as the file's problem.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

DumpFault = Literal["not_a_dict", "no_keys", "version_not_text", "entries_not_a_list", "config_not_a_dict"]
EntryFault = Literal["not_a_dict", "no_keys", "process_group_not_a_pair", "names_not_text", "number_out_of_range",
                     "time_not_ns", "state_or_dtypes_not_text", "frames_or_sizes_not_lists", "frame_not_a_site",
                     "sizes_not_integers"]

_DUMP: dict[DumpFault, str] = {
    "not_a_dict": "it holds {a_found}, not a Flight Recorder dump's dict",
    "no_keys": "it has no {missing}: not a Flight Recorder dump",
    "version_not_text": "its version is {a_found}, not a string",
    "entries_not_a_list": "its entries are {a_found}, not a list",
    "config_not_a_dict": "its {key} is {a_found}, not a dict",
}

_ENTRY: dict[EntryFault, str] = {
    "not_a_dict": "entry {entry} is {a_found}, not a dict",
    "no_keys": "entry {entry} has no {missing}",
    "process_group_not_a_pair": "entry {entry}'s process_group is not (name, description)",
    "names_not_text": "entry {entry}'s profiling_name or process_group is not text",
    "number_out_of_range": "entry {entry}'s {key} is not a number from 0 to 2**40",
    "time_not_ns": "entry {entry}'s {key} is not a time in nanoseconds",
    "state_or_dtypes_not_text": "entry {entry}'s state or input_dtypes are not text",
    "frames_or_sizes_not_lists": "entry {entry}'s frames or input_sizes are not lists",
    "frame_not_a_site": "entry {entry} has a frame that is not a file name and a line number",
    "sizes_not_integers": "entry {entry}'s input_sizes are not lists of integers",
}


def dump_fault(fault: DumpFault, *, found: str = "", missing: Sequence[str] = (), key: str = "") -> str:
    """What is wrong with the dump as a whole: ``found`` is the name of the type found where another belongs,
    ``missing`` the top-level fields it lacks, ``key`` the field (``pg_config``/``pg_status``) at fault."""
    return _DUMP[fault].format(a_found=_a(found), missing=" or ".join(missing), key=key)


def entry_fault(entry: int, fault: EntryFault, *, found: str = "", missing: Sequence[str] = (), key: str = "") -> str:
    """What is wrong with the dump's entry number ``entry`` (``found``, ``missing``, ``key`` as for
    :func:`dump_fault`, of the entry)."""
    return _ENTRY[fault].format(entry=entry, a_found=_a(found), missing=", ".join(missing), key=key)


def _a(name: str) -> str:
    """A type's name with its article: ``an int``, ``a list``."""
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"
