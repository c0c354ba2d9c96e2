"""The processes d3stream starts run the code of the process that starts them, whatever the current folder.

A worker started in a folder that holds another ``d3stream/`` (a checkout of another version, a copy under
edit) started its media decoding process with ``python -m`` there, and ``-m`` puts the current folder first on
``sys.path``: the child imported that other code (issue 43). Here the folder holds a fake package that leaves a
mark when it is imported, and the decoding process must neither import it nor fail for it.
"""

from __future__ import annotations

import asyncio
import pkgutil
from pathlib import Path

import pytest

import d3stream
from d3stream.core.decoding import ProcessDecoder


@pytest.fixture
def folder_with_another_d3stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current folder, holding a ``d3stream/`` package that marks its import (and holds nothing else)."""
    fake = tmp_path / "d3stream"
    fake.mkdir()
    (fake / "__init__.py").write_text("import pathlib\npathlib.Path(__file__).with_name('imported').touch()\n",
                                      encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return fake


def test_the_decoding_process_imports_its_parents_d3stream_not_the_current_folders(folder_with_another_d3stream):
    decoder = ProcessDecoder(processes=1, timeout_s=120)
    try:
        # A job that says where the decoding process found the package (by name: pickled as a reference).
        found = asyncio.run(decoder.run(pkgutil.resolve_name, "d3stream:__file__"))
    finally:
        decoder.close()
    assert Path(found).resolve() == Path(d3stream.__file__).resolve()
    assert not (folder_with_another_d3stream / "imported").exists()
