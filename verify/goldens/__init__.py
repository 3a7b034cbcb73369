"""Goldens: reviewed text files of canonical graphs and stats under ``goldens/``.

``text`` (format, reading, rendering), ``catalog`` (which scenarios and stages have goldens),
``cli`` (``python -m verify goldens``) and ``syrupy_ext`` (the pytest side; the only module that
imports syrupy). The names below are the text API, importable without test dependencies.
"""

from verify.goldens.text import (
    FORMAT_LINE,
    GOLDENS_DIR,
    TESTS_DIR,
    UPDATE_COMMAND,
    CorruptGoldenError,
    collective_counts_text,
    golden_diff,
    golden_dir_for,
    golden_sections,
    goldens_root_for,
    graph_golden_text,
    header_text,
    read_golden,
    render_golden,
)

__all__ = [
    "FORMAT_LINE",
    "GOLDENS_DIR",
    "TESTS_DIR",
    "UPDATE_COMMAND",
    "CorruptGoldenError",
    "collective_counts_text",
    "golden_dir_for",
    "golden_diff",
    "golden_sections",
    "goldens_root_for",
    "graph_golden_text",
    "header_text",
    "read_golden",
    "render_golden",
]
