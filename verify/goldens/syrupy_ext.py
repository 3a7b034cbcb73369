"""The syrupy extension that stores goldens as one UTF-8 ``.txt`` per snapshot under ``goldens/``.

This is the only module of ``verify`` that imports syrupy (a test-only dependency): the report and
the other CLI commands read goldens through ``verify.goldens.text`` and work on a base install.
"""

from __future__ import annotations

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode
from syrupy.location import PyTestLocation

from verify.goldens.text import golden_dir_for, read_golden


class GoldenTextExtension(SingleFileSnapshotExtension):
    """One UTF-8 ``.txt`` per snapshot, under the top-level ``goldens/`` tree."""

    _write_mode = WriteMode.TEXT
    file_extension = "txt"

    @classmethod
    def dirname(cls, *, test_location: PyTestLocation) -> str:
        return str(golden_dir_for(test_location.filepath))

    def read_snapshot_data_from_location(self, *, snapshot_location: str, snapshot_name: str, session_id: str):
        try:
            return read_golden(snapshot_location)
        except FileNotFoundError:
            return None
