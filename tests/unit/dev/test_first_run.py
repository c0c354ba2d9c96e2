"""What a newcomer's first ``d3stream demo`` shows on the screen, piece by piece, without the servers.

A run that works should read clean: Maven's output in a log file (its tail and path on the screen only when
the resolve fails), the Kafka client's reports of a coordinator that is still starting below ``warning``
(but a condition that lasts shown at its own level), transformers' kernel-fallback warnings replaced by
one plain sentence, and log lines that do not tear a progress bar apart.
"""

from __future__ import annotations

import json
import logging
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import GroupAuthorizationFailedError, GroupCoordinatorNotAvailableError

from d3stream.dev import infra
from d3stream.dev.infra import jars
from d3stream.ops import logs

COORDINATOR = "aiokafka.consumer.group_coordinator"
KERNELS = "transformers.integrations.hub_kernels"


def _fake_mvn(folder: Path, body: str) -> None:
    """An ``mvn`` on PATH that prints a screen of Maven-like lines, then does ``body`` (shell)."""
    folder.mkdir()
    script = folder / "mvn"
    script.write_text(
        "#!/bin/sh\n"
        'for i in 1 2 3 4 5; do echo "[INFO] Downloading from central: artifact $i"; done\n' + body
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A jar cache of this test's own, so nothing resolved for the session's servers is touched."""
    monkeypatch.setenv("D3STREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_failing_maven_resolve_shows_the_log_tail_and_its_path(own_cache, monkeypatch, capsys):
    _fake_mvn(own_cache / "bin", 'echo "[ERROR] Could not resolve dependencies: no network"\nexit 1\n')
    monkeypatch.setenv("PATH", f"{own_cache / 'bin'}:/usr/bin:/bin")
    with pytest.raises(infra.InfraError) as raised:
        infra.ensure_jars(progress=True)
    log_path = jars._cache_dir() / "maven.log"
    message = str(raised.value)
    assert str(log_path) in message
    assert "[ERROR] Could not resolve dependencies: no network" in message  # the tail says what went wrong
    assert "[INFO] Downloading from central" in log_path.read_text()
    screen = capsys.readouterr()
    assert "[INFO]" not in screen.out + screen.err  # Maven's output only in the log and the error
    assert str(log_path) in screen.err  # the one line saying what runs and where its output goes


def test_a_working_maven_resolve_keeps_its_output_off_the_screen(own_cache, monkeypatch, capsys):
    # The fake mvn "resolves" by creating the two jars the servers need in -DoutputDirectory.
    _fake_mvn(
        own_cache / "bin",
        'for arg in "$@"; do case "$arg" in -DoutputDirectory=*) out="${arg#-DoutputDirectory=}";; esac; done\n'
        'mkdir -p "$out" && touch "$out/kafka_2.13-4.0.0.jar" "$out/s3proxy-2.6.0-jar-with-dependencies.jar"\n',
    )
    monkeypatch.setenv("PATH", f"{own_cache / 'bin'}:/usr/bin:/bin")
    lib = infra.ensure_jars(progress=True)
    assert (lib / "kafka_2.13-4.0.0.jar").is_file()
    screen = capsys.readouterr()
    assert "[INFO]" not in screen.out + screen.err
    assert "Maven" in screen.err and screen.err.count("\n") == 1
    infra.ensure_jars(progress=True)  # resolved: a second run says nothing at all
    assert capsys.readouterr().err == ""


@pytest.fixture
def logging_at(capsys: pytest.CaptureFixture[str]) -> Iterator[object]:
    """``configure_logging`` as the commands call it (JSON lines, so the level can be read back), undone after."""
    restores = []

    def configure(level: str) -> None:
        restores.append(logs.configure_logging("json", level))

    yield configure
    for restore in reversed(restores):
        restore()


def _lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_a_coordinator_that_is_still_starting_is_logged_below_warning(logging_at, capsys):
    logging_at("warning")  # the demo's level
    logging.getLogger(COORDINATOR).error("Group Coordinator Request failed: %s", GroupCoordinatorNotAvailableError())
    logging.getLogger(COORDINATOR).warning("Marking the coordinator dead (node %s)for group %s.", 1, "demo")
    assert _lines(capsys.readouterr().err) == []
    logging_at("info")  # serve's level: still there to read, at info
    logging.getLogger(COORDINATOR).error("Group Coordinator Request failed: %s", GroupCoordinatorNotAvailableError())
    (line,) = _lines(capsys.readouterr().err)
    assert line["level"] == "info" and "GroupCoordinatorNotAvailable" in str(line["event"])


def test_a_produce_retried_right_after_topic_creation_is_logged_below_warning(logging_at, capsys):
    """make demo printed three of these (NotEnoughReplicas while a new topic's replicas come up) before the
    answers; aiokafka retries them by itself, and the run succeeded."""
    from aiokafka.errors import NotEnoughReplicasError
    from aiokafka.structs import TopicPartition

    logging_at("warning")
    logging.getLogger("aiokafka.producer.sender").warning(
        "Got error produce response on topic-partition %s, retrying. Error: %s",
        TopicPartition("demo.evaluations", 2), NotEnoughReplicasError)
    assert _lines(capsys.readouterr().err) == []


def test_real_kafka_client_errors_keep_their_level(logging_at, capsys):
    logging_at("warning")
    # Not retriable: aiokafka raises it, so it is no start-up condition.
    logging.getLogger(COORDINATOR).error("Group Coordinator Request failed: %s", GroupAuthorizationFailedError())
    logging.getLogger(COORDINATOR).error("Heartbeat session expired - marking coordinator dead")
    assert [line["level"] for line in _lines(capsys.readouterr().err)] == ["error", "error"]


def test_a_coordinator_that_never_comes_is_shown_at_its_own_level():
    now = [0.0]
    levels = logs._Levels(logging.WARNING, grace_s=30.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        return logging.LogRecord(COORDINATOR, logging.ERROR, __file__, 1, "Group Coordinator Request failed: %s",
                                 (GroupCoordinatorNotAvailableError(),), None)

    shown = []
    for second in range(0, 60, 5):  # one record every 5 s, as aiokafka retries: the condition goes on
        now[0] = float(second)
        each = record()
        shown.append(levels.filter(each) and each.levelname)
    assert shown[0] is False and shown[-1] == "ERROR"
    now[0] += 600.0  # long quiet, then the broker restarts: a new, young condition again
    assert levels.filter(record()) is False


def test_the_kernel_fallback_warning_is_at_debug_and_said_once_in_plain_words(logging_at, capsys):
    logging_at("info")
    text = ("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
            "`flash-linear-attention` is not installed. This is correct but much slower; install "
            "`flash-linear-attention` for the optimized kernel.")
    logging.getLogger(KERNELS).warning(text)
    assert _lines(capsys.readouterr().err) == []
    logging_at("debug")
    logging.getLogger(KERNELS).warning(text)
    assert [line["level"] for line in _lines(capsys.readouterr().err)] == ["debug"]
    reference = {"path": "reference", "causal_conv1d_fn": "torch-reference"}
    notice = logs.kernel_notice(reference, "cpu")
    assert notice is not None and "CPU" in notice and "docs/GPU.md" in notice
    assert logs.kernel_notice({"path": "fast"}, "cuda:0") is None
    assert logs.kernel_notice({"path": "none"}, "cpu") is None  # a Qwen3-VL backbone: nothing to say


def test_log_lines_go_above_a_progress_bar_and_keep_their_levels(logging_at, capsys):
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    logging_at("warning")
    with logging_redirect_tqdm(), tqdm(total=2, file=sys.stderr) as bar:
        logging.getLogger(COORDINATOR).error("Group Coordinator Request failed: %s",
                                             GroupCoordinatorNotAvailableError())
        logging.getLogger("d3stream.test").warning("a real warning")
        bar.update()
    lines = _lines(capsys.readouterr().err)
    # The redirect keeps the filter: the starting coordinator stays below the demo's level, a warning shows.
    assert [line["event"] for line in lines] == ["a real warning"]


def test_serve_says_once_that_its_models_run_reference_kernels(logging_at, capsys):
    from d3stream.cli.serve import _log_kernel_notice

    class Model:  # what the notice reads of a D3
        device = "cpu"

        def kernel_record(self) -> dict[str, str]:
            return {"path": "reference", "torch_chunk_gated_delta_rule": "torch-reference"}

    logging_at("info")  # serve's default level
    _log_kernel_notice([Model(), Model()])  # two models in one process: the kernels are the process's, said once
    (line,) = _lines(capsys.readouterr().err)
    assert line["level"] == "info" and "docs/GPU.md" in str(line["event"])
