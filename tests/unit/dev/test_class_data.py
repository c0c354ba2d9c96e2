"""The servers' class-data archives (d3stream/dev/infra/class_data.py) without a JVM: which flags a start gets, and
that only a clean exit's archive is ever kept (tests/integration/test_infra.py starts a real server from one)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from d3stream.dev.infra.class_data import ClassDataArchive


def _written_by_the_jvm(flags: list[str]) -> Path:
    """What the JVM does at exit with ``-XX:ArchiveClassesAtExit=PATH``: writes the archive there."""
    (flag,) = flags
    assert flag.startswith("-XX:ArchiveClassesAtExit=")
    pending = Path(flag.split("=", 1)[1])
    pending.write_bytes(b"classes")
    return pending


def test_only_a_clean_exit_keeps_the_archive_and_the_next_start_uses_it(tmp_path: Path) -> None:
    archive = ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar:b.jar")
    assert archive.reuse_only() == [], "a helper run never writes the server's archive"

    pending = _written_by_the_jvm(archive.options())
    archive.exited(cleanly=False)  # killed, or it never became ready: the file may be half written
    assert not pending.exists() and not archive.path.exists()

    pending = _written_by_the_jvm(archive.options())
    archive.exited(cleanly=True)
    assert not pending.exists() and archive.path.read_bytes() == b"classes"
    assert archive.options() == archive.reuse_only() == [f"-XX:SharedArchiveFile={archive.path}"]


def test_the_archive_is_named_after_the_java_and_the_classes_it_was_made_from(tmp_path: Path) -> None:
    one = ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar:b.jar").path
    assert ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar:b.jar").path == one
    assert ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar:c.jar").path != one
    assert ClassDataArchive.of(tmp_path, "kafka", "/opt/java-25/bin/java", "a.jar:b.jar").path != one
    assert ClassDataArchive.of(tmp_path, "s3proxy", "/usr/bin/java", "a.jar:b.jar").path != one


def test_pending_archives_left_by_a_parent_that_died_are_swept_after_a_day(tmp_path: Path) -> None:
    archive = ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar")
    old, recent = (archive.path.with_name(f"{archive.path.stem}.{name}.partial") for name in ("old", "recent"))
    for left in (old, recent):
        left.write_bytes(b"classes")
    two_days_ago = time.time() - 2 * 86_400
    os.utime(old, (two_days_ago, two_days_ago))
    archive.options()
    assert not old.exists() and recent.exists(), "a recent one may be a server still running"


def test_a_server_not_asked_to_use_archives_gets_no_flags_and_writes_nothing(tmp_path: Path) -> None:
    archive = ClassDataArchive.of(tmp_path, "kafka", "/usr/bin/java", "a.jar", wanted=False)
    archive.path.write_bytes(b"classes")  # even where one exists
    assert archive.options() == archive.reuse_only() == []
    archive.exited(cleanly=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [archive.path.name]
