"""Reports from a memlord profile: JSON, Chrome/Perfetto trace, torch memory snapshot
pickle, and a self-contained HTML report.

    from memlord.report import export, load
    export(doc, "profile.json")        # the document (read back with load())
    export(doc, "profile.trace.json")  # Perfetto / chrome://tracing
    export(doc, "profile.pickle")      # torch.cuda._memory_viz, pytorch.org/memory_viz
    export(doc, "report.html")         # needs: pip install memlord[report]

docs/reports.md describes the document and every format.
"""

from __future__ import annotations

import os

from ._json import dumps, from_dict, load, to_dict, write_json
from ._model import (
    EVENT_COLUMNS,
    KNOWN_KINDS,
    SAMPLE_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    Events,
    Profile,
    SampleBuilder,
    Samples,
    Span,
    check_arguments,
    concat_events,
)
from ._pickle import to_snapshot, write_pickle
from ._postmortem import SCHEMA as POST_MORTEM_SCHEMA
from ._postmortem import build_post_mortem, load_post_mortem, write_post_mortem
from ._series import Series, decimate_indices, lanes, memory_series
from ._trace import write_trace
from ._util import Progress, ProgressBar, no_progress
from ._validate import ProfileError

__all__ = [
    "EVENT_COLUMNS",
    "KNOWN_KINDS",
    "POST_MORTEM_SCHEMA",
    "SAMPLE_COLUMNS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Events",
    "Profile",
    "ProfileError",
    "Progress",
    "ProgressBar",
    "SampleBuilder",
    "Samples",
    "Series",
    "Span",
    "build_post_mortem",
    "concat_events",
    "decimate_indices",
    "dumps",
    "export",
    "format_of",
    "from_dict",
    "lanes",
    "load",
    "load_post_mortem",
    "memory_series",
    "no_progress",
    "to_dict",
    "to_snapshot",
    "write_html",
    "write_json",
    "write_pickle",
    "write_post_mortem",
    "write_trace",
]

FORMATS = {
    ".trace.json": "trace",
    ".json": "json",
    ".pickle": "pickle",
    ".pkl": "pickle",
    ".html": "html",
    ".htm": "html",
}


def format_of(path: str | os.PathLike[str]) -> str:
    """The format a file name asks for: "json", "trace", "pickle" or "html"."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"format_of(): argument 'path' must be a str or os.PathLike, not {type(path).__name__}"
        )
    name = os.fspath(path).lower()
    for suffix, fmt in FORMATS.items():
        if name.endswith(suffix):
            return fmt
    raise ValueError(
        f"path {os.fspath(path)!r}: unknown report format; use a name ending in "
        + ", ".join(FORMATS)
    )


def write_html(
    doc: Profile, path: str | os.PathLike[str], progress: Progress = no_progress
) -> None:
    """The HTML report (needs plotly: pip install memlord[report])."""
    check_arguments("write_html", doc, path, progress)
    from ._html import write_html as _write

    _write(doc, path, progress)


def export(doc: Profile, path: str | os.PathLike[str], *, progress: Progress = no_progress) -> str:
    """Write ``doc`` to ``path`` in the format its name asks for (``.json``,
    ``.trace.json``, ``.pickle``/``.pkl``, ``.html``/``.htm``) and return the format."""
    check_arguments("export", doc, path, progress)
    fmt = format_of(path)
    writer = {
        "json": write_json,
        "trace": write_trace,
        "pickle": write_pickle,
        "html": write_html,
    }[fmt]
    writer(doc, path, progress)
    return fmt
