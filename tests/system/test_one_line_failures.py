"""Every expected failure of a command is one line on stderr, naming what failed, where, and the setting or flag
to change, with exit status 2 and no traceback; Ctrl-C and SIGTERM end a command with no traceback (issue 43).

Each command runs as ``python -m d3stream`` in a process of its own, with no ``D3STREAM_*`` variable of the
machine, and its stderr is read whole. The first tests need no server (an address nobody listens on is
the failure); the others use the session's broker: a checkpoint, a port, a topic, a registry or credentials that
are wrong while Kafka itself answers. A wrong password on a broker that checks it is
tests/integration/test_security.py's (a broker of its own); here SASL towards the plain listener gives the same
refusal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.model_fixtures import copy_checkpoint
from tests.support.stream_helpers import free_port

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
REQUESTS = REPO / "examples" / "requests.jsonl"
# Long enough for a command that imports torch on a busy machine; a command that hangs fails the test here.
COMMAND_TIMEOUT_S = 180


def _environment() -> dict[str, str]:
    """This machine's environment less d3stream's own variables (a D3STREAM_CONFIG of the machine would change
    what the commands read), with AWS credentials that an s3:// checkpoint needs before its endpoint is tried."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("D3STREAM_")}
    env.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_REGION="us-east-1", PYTHONUNBUFFERED="1")
    return env


def d3stream(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "d3stream", *args], capture_output=True, text=True, cwd=REPO,
                          env={**_environment(), **(env or {})}, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)


def one_line(result: subprocess.CompletedProcess[str], command: str, *named: str) -> str:
    """The failure's line, after checking that it is the whole of stderr, exit status 2, and names ``named``."""
    shown = f"exit status {result.returncode}, stderr:\n{result.stderr}"
    assert result.returncode == 2, shown
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr, shown
    lines = result.stderr.splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith(f"d3stream {command}: "), shown
    for word in named:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"
    return lines[0]


@pytest.fixture
def nowhere() -> str:
    """A Kafka address nobody listens on."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def not_a_checkpoint(tmp_path: Path) -> Path:
    """A folder that holds files, none of a checkpoint."""
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("a folder, not a checkpoint\n", encoding="utf-8")
    return folder


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something already listens on (another worker, as it were)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


# ------------------------------------------------------------------------------------------ without a server


def test_serve_says_in_one_line_that_kafka_does_not_answer_before_it_loads_the_model(qwen35_text_checkpoint, nowhere):
    # No metrics endpoint (the default port may be another worker's on this machine; with one, its "listening"
    # log line would come first).
    result = d3stream("serve", "--model", str(qwen35_text_checkpoint), "--bootstrap-servers", nowhere,
                      "--metrics-port", "")
    one_line(result, "serve", f"cannot connect to Kafka at {nowhere}", "bootstrap_servers")


def test_debug_logging_adds_the_traceback_to_the_one_line(nowhere):
    result = d3stream("consume", "d3.answers", "--bootstrap-servers", nowhere, env={"D3STREAM_LOG_LEVEL": "debug"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" in result.stderr and "KafkaConnectionError" in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"d3stream consume: cannot connect to Kafka at {nowhere}")


@pytest.mark.parametrize("command", ["evaluate", "evaluate --report", "consume d3.answers", "produce d3.requests",
                                     "replay", "compare"])
def test_every_kafka_command_says_in_one_line_that_kafka_does_not_answer(command, nowhere, qwen35_text_checkpoint,
                                                                         tmp_path):
    words = command.split()
    extra = {
        "produce": [str(REQUESTS)],
        "replay": ["--from-topic", "d3.requests", "--replay-id", "r1", "--out", str(tmp_path / "replayed.jsonl"),
                   "--model", str(qwen35_text_checkpoint)],
        "compare": ["kafka:d3.answers", str(REQUESTS), "--out", str(tmp_path / "report")],
    }.get(words[0], [])
    no_endpoint = ["--metrics-port", ""] if words == ["evaluate"] else []  # as serve's above
    result = d3stream(*words, *extra, *no_endpoint, "--bootstrap-servers", nowhere)
    one_line(result, words[0], f"cannot connect to Kafka at {nowhere}", "bootstrap_servers")


def test_schemas_register_says_in_one_line_that_the_registry_does_not_answer():
    url = f"http://127.0.0.1:{free_port()}"
    result = d3stream("schemas", "register", "--schema-registry-url", url, "--answer-format", "avro")
    one_line(result, "schemas register", f"the Schema Registry at {url} did not answer", "--schema-registry-url")


def test_decide_names_the_folder_that_is_not_a_checkpoint(not_a_checkpoint, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(REQUESTS.read_text(encoding="utf-8").splitlines()[0], encoding="utf-8")
    result = d3stream("decide", "--model", str(not_a_checkpoint), "--request", str(request))
    one_line(result, "decide", f"--model {not_a_checkpoint}", "not a d3stream checkpoint", "make-checkpoint")


def test_serve_and_replay_name_a_checkpoint_that_is_missing_or_is_not_one_before_they_ask_kafka(
        not_a_checkpoint, nowhere, tmp_path):
    """A typo in a path needs no broker to be seen (none answers here)."""
    replay = ["--from-topic", "d3.requests", "--replay-id", "r1", "--out", str(tmp_path / "replayed.jsonl")]
    for command, options in (("serve", ["--metrics-port", ""]), ("replay", replay)):
        missing = d3stream(command, "--model", "/no/such/checkpoint", "--bootstrap-servers", nowhere, *options)
        one_line(missing, command, "--model /no/such/checkpoint: no checkpoint directory", "make-checkpoint")
        wrong = d3stream(command, "--model", str(not_a_checkpoint), "--bootstrap-servers", nowhere, *options)
        one_line(wrong, command, f"--model {not_a_checkpoint}: not a d3stream checkpoint", "decision_config.json")


def test_serve_names_a_checkpoint_whose_files_do_not_load(kafka_broker, qwen35_text_checkpoint, tmp_path):
    broken = copy_checkpoint(qwen35_text_checkpoint, tmp_path / "broken")
    (broken / "config.json").write_text("{", encoding="utf-8")
    (broken / "MODEL_MANIFEST.json").unlink()  # unverified: the load itself meets the broken file
    result = d3stream("serve", "--model", str(broken), "--bootstrap-servers", kafka_broker.bootstrap_servers,
                      "--metrics-port", "")
    one_line(result, "serve", f"--model {broken}: cannot load the checkpoint", "make-checkpoint")


def test_produce_sends_nothing_of_a_file_with_a_line_that_is_not_a_request(tmp_path, nowhere):
    """Checked before Kafka is even asked: each bad line with its number and the worker's reason, then one line
    saying nothing was sent (the address here answers nothing: no record could have gone anywhere)."""
    good = REQUESTS.read_text(encoding="utf-8").splitlines()
    lines = [good[0], '{"id": "no-questions", "state": 1}', "", "not json", good[1]]
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = d3stream("produce", "d3.requests", str(source), "--bootstrap-servers", nowhere)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    listed, last = result.stderr.splitlines()[:-1], result.stderr.splitlines()[-1]
    assert [line.split(": ")[1] for line in listed] == [f"{source}:2", f"{source}:4"]
    assert "invalid_request" in listed[0] and "questions" in listed[0]
    assert "undecodable_event" in listed[1]
    assert last == ("d3stream produce: 2 of 4 lines are not a valid request; nothing was sent (--skip-invalid sends "
                    "the valid ones, --unchecked every line as it stands)")


def test_produce_tells_labels_published_as_requests_to_pass_labels(tmp_path, nowhere):
    source = tmp_path / "labels.jsonl"
    source.write_text(json.dumps({"id": "ticket-1001", "labels": {"team": "billing"}}) + "\n", encoding="utf-8")
    result = d3stream("produce", "d3.labels", str(source), "--bootstrap-servers", nowhere)
    assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith("pass --labels"), result.stderr
    labelled = d3stream("produce", "d3.labels", str(source), "--labels", "--bootstrap-servers", nowhere)
    one_line(labelled, "produce", "cannot connect to Kafka")  # checked as a label: on to Kafka


# ------------------------------------------------------------------------------------------ with the broker


def test_serve_names_the_object_store_that_does_not_answer(kafka_broker):
    endpoint = f"http://127.0.0.1:{free_port()}"
    result = d3stream("serve", "--model", "s3://models/d3/", "--model-allowlist", "models",
                      "--s3-endpoint-url", endpoint, "--s3-max-attempts", "1", "--s3-connect-timeout", "2",
                      "--bootstrap-servers", kafka_broker.bootstrap_servers, "--metrics-port", "")
    one_line(result, "serve", "s3://models/d3/", "s3_endpoint_url")


@pytest.mark.parametrize("command", ["serve", "evaluate"])
def test_a_metrics_port_that_is_taken_is_one_line_naming_the_flag(command, kafka_broker, taken_port,
                                                                  qwen35_text_checkpoint):
    model = ["--model", str(qwen35_text_checkpoint)] if command == "serve" else []
    result = d3stream(command, *model, "--bootstrap-servers", kafka_broker.bootstrap_servers,
                      "--metrics-port", str(taken_port))
    one_line(result, command, f"port {taken_port} on 127.0.0.1 is taken", "--metrics-port")


def test_consume_of_a_topic_that_does_not_exist_says_so_at_once(kafka_broker, topic_names):
    real = topic_names("answers")
    kafka_broker.create_topic(real, 1, exist_ok=True)
    typo = real[:-1] + ("z" if real[-1] != "z" else "y")
    result = d3stream("consume", typo, "--max", "4", "--bootstrap-servers", kafka_broker.bootstrap_servers)
    # The closest name first; other tests' topics on the shared broker may follow it.
    one_line(result, "consume", f"topic {typo} does not exist", f"did you mean {real}", "--wait-for-topic")


def test_produce_names_the_registry_that_does_not_answer(kafka_broker):
    url = f"http://127.0.0.1:{free_port()}"
    result = d3stream("produce", "d3.requests", str(REQUESTS), "--format", "avro", "--schema-registry-url", url,
                      "--bootstrap-servers", kafka_broker.bootstrap_servers)
    one_line(result, "produce", f"the Schema Registry at {url} did not answer", "--schema-registry-url")


def test_serve_with_refused_credentials_names_the_password_setting(kafka_broker, qwen35_text_checkpoint):
    result = d3stream("serve", "--model", str(qwen35_text_checkpoint), "--bootstrap-servers",
                      kafka_broker.bootstrap_servers, "--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism",
                      "SCRAM-SHA-512", "--sasl-username", "d3", "--sasl-password", "wrong", "--metrics-port", "")
    one_line(result, "serve", "SASL authentication", "sasl_password")


def test_produce_skip_invalid_sends_the_valid_lines_and_lists_the_others(kafka_broker, topic_names, tmp_path):
    topic = topic_names("requests")
    kafka_broker.create_topic(topic, 1, exist_ok=True)
    good = REQUESTS.read_text(encoding="utf-8").splitlines()
    source = tmp_path / "some-bad.jsonl"
    source.write_text("\n".join([good[0], "{oops", good[1]]) + "\n", encoding="utf-8")
    servers = ["--bootstrap-servers", kafka_broker.bootstrap_servers]
    refused = d3stream("produce", topic, str(source), *servers)
    assert refused.returncode == 2 and "nothing was sent" in refused.stderr, refused.stderr
    skipped = d3stream("produce", topic, str(source), "--skip-invalid", *servers)
    assert skipped.returncode == 1, skipped.stderr
    assert skipped.stderr.splitlines()[0].startswith(f"d3stream produce: {source}:2: undecodable_event")
    assert skipped.stderr.splitlines()[-1] == f"published 2 records to {topic}; 1 invalid line left out (listed above)"
    read = d3stream("consume", topic, "--max", "2", "--timeout", "60", *servers)
    assert read.returncode == 0, read.stderr
    assert [json.loads(line)["id"] for line in read.stdout.splitlines()] == [json.loads(good[0])["id"],
                                                                             json.loads(good[1])["id"]]


# ------------------------------------------------------------------------------------------ Ctrl-C and SIGTERM


def _start(*args: str, log: Path) -> subprocess.Popen[bytes]:
    """A command in a session of its own (a signal to its group is what a terminal's Ctrl-C sends)."""
    with log.open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "d3stream", *args], cwd=REPO, env=_environment(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def _wait_for(process: subprocess.Popen[bytes], log: Path, event: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while f'"event": "{event}"' not in log.read_text(encoding="utf-8", errors="replace"):
        assert process.poll() is None, f"it ended before {event!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {event!r} within {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _signalled(process: subprocess.Popen[bytes], signum: int, log: Path) -> tuple[int, str]:
    """Send ``signum`` to the command's whole group, as a terminal does; its exit status and stderr."""
    os.killpg(process.pid, signum)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"still running 120 s after the signal:\n{log.read_text()[-3000:]}") from None
    return process.returncode, log.read_text(encoding="utf-8", errors="replace")


def _children(pid: int) -> list[str]:
    """The command lines of a process's children (Linux)."""
    listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode() for child in listed]


def test_ctrl_c_stops_serve_and_its_decoding_process_without_a_traceback(stack, qwen35_checkpoint, tmp_path):
    log = tmp_path / "serve.log"
    worker = _start(*stack.serve_command(qwen35_checkpoint, "--log-format", "json", "--metrics-port", "")[3:],
                    log=log)
    try:
        _wait_for(worker, log, "serving")
        children = _children(worker.pid)
        assert any("d3stream.core.decoding" in child for child in children), children  # the one Ctrl-C reached
        status, stderr = _signalled(worker, signal.SIGINT, log)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
    assert status == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert '"event": "stopped"' in stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_ends_consume_with_nothing_on_stderr(signum, kafka_broker, topic_names, tmp_path):
    topic = topic_names("answers")
    kafka_broker.create_topic(topic, 1, exist_ok=True)
    log = tmp_path / "consume.log"
    reader = _start("consume", topic, "--bootstrap-servers", kafka_broker.bootstrap_servers, log=log)
    try:
        time.sleep(5)  # reading: an empty topic, until --timeout
        assert reader.poll() is None, log.read_text()
        status, stderr = _signalled(reader, signum, log)
    finally:
        if reader.poll() is None:
            os.killpg(reader.pid, signal.SIGKILL)
    assert status == (130 if signum == signal.SIGINT else -signal.SIGTERM), stderr
    assert stderr == ""


def test_ctrl_c_stops_evaluate_without_a_traceback(kafka_broker, topic_names, tmp_path):
    names = {flag: topic_names(flag) for flag in ("answer-topic", "label-topic", "evaluation-topic",
                                                   "label-dead-letter-topic", "evaluate-state-topic",
                                                   "evaluate-group-id", "transactional-id-prefix")}
    log = tmp_path / "evaluate.log"
    options = [part for flag, name in names.items() for part in (f"--{flag}", name)]
    evaluator = _start("evaluate", *options, "--evaluate-state-dir", str(tmp_path / "state"), "--log-format", "json",
                       "--metrics-port", "", "--bootstrap-servers", kafka_broker.bootstrap_servers, log=log)
    try:
        _wait_for(evaluator, log, "evaluating partition")
        status, stderr = _signalled(evaluator, signal.SIGINT, log)
    finally:
        if evaluator.poll() is None:
            os.killpg(evaluator.pid, signal.SIGKILL)
    assert status == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
