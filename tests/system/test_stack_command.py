"""``d3stream stack`` runs the README's "Your own stream" as written: the stack started in the background with
``--env-file``, the section's bash block run with the environment from that file, every request of
``examples/requests.jsonl`` answered, and Ctrl-C (SIGINT) stopping the stack with exit status 0 and its servers
gone. And a stack with ``--data-dir`` stopped by SIGTERM (exit 0) comes back, on fresh ports, with its records
and objects.

The commands are read out of README.md, so a README edit that breaks them breaks this test. One is not run as
written: ``make-checkpoint ... --train demo`` trains for a minute, so its output folder is the session's tiny
checkpoint instead (``tests/unit/dev`` tests the training); what the other commands do with it is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.model_fixtures import copy_checkpoint

# It starts the JVM servers itself (no session fixture tells tests/conftest.py so), and a worker beside them.
pytestmark = [pytest.mark.infra, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
REQUESTS = REPO / "examples" / "requests.jsonl"
# A bound on each command of the README, below the test's own, so that a command that hangs is named and the
# stack and the worker are still stopped by this test.
COMMAND_TIMEOUT_S = 420


def readme_commands(title: str = "Your own stream") -> list[tuple[list[str], bool]]:
    """The commands of the bash block of README.md's section ``title``, as (words, run in the background)."""
    text = README.read_text(encoding="utf-8")
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found, f"README.md's '{title}' has no bash block"
    commands = []
    for line in found.group(1).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            background = words[-1] == "&"
            commands.append((words[:-1] if background else words, background))
    return commands


def read_env_file(path: Path) -> dict[str, str]:
    """``export NAME=value`` lines as a shell that sources them would set them."""
    variables = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        export, assignment = shlex.split(line)
        assert export == "export", line
        name, value = assignment.split("=", 1)
        variables[name] = value
    return variables


def _environment() -> dict[str, str]:
    """This test's environment as a newcomer's terminal: d3stream importable from this checkout, no AWS
    profile or settings file of the machine in the way, and no metrics endpoint (its default port may be held
    by another test's worker; the README's commands do not use it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "clients" / "python"),
                                                    env.get("PYTHONPATH")) if p)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "D3STREAM_CONFIG"):
        env.pop(name, None)
    env["D3STREAM_METRICS_PORT"] = ""
    return env


def _d3stream(words: list[str]) -> list[str]:
    assert words[0] == "d3stream", f"the README's block runs d3stream commands only: {words}"
    return [sys.executable, "-m", "d3stream", *words[1:]]


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def _addresses(env: dict[str, str]) -> list[str]:
    """host:port of the broker, the store and the registry, from the env file."""
    urls = [env["D3STREAM_S3_ENDPOINT_URL"], env["D3STREAM_SCHEMA_REGISTRY_URL"]]
    return [env["D3STREAM_BOOTSTRAP_SERVERS"], *(str(urlsplit(url).netloc) for url in urls)]


def _stop(process: subprocess.Popen, signum: int) -> int:
    if process.poll() is None:
        process.send_signal(signum)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _run_readme(tmp_path: Path, env: dict[str, str], checkpoint: Path, title: str = "Your own stream") -> list[dict]:
    """Run the README's block of section ``title`` in ``tmp_path`` as a terminal would; the answers its
    ``consume`` printed."""
    answers = None
    background: list[subprocess.Popen] = []
    try:
        for words, in_background in readme_commands(title):
            if words[1] == "make-checkpoint":
                copy_checkpoint(checkpoint, tmp_path / words[2])
                continue
            if in_background:
                # A log per command and block: the second block's serve does not overwrite the first's.
                with open(tmp_path / f"{words[1]}-{title.split()[0].lower()}.log", "w") as log:
                    background.append(subprocess.Popen(_d3stream(words), cwd=tmp_path, env=env, stdout=log,
                                                       stderr=subprocess.STDOUT))
                continue
            done = subprocess.run(_d3stream(words), cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            assert done.returncode == 0, f"{shlex.join(words)} exited with {done.returncode}:\n{done.stderr}"
            if words[1] == "consume":
                answers = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    finally:
        for process in background:
            _stop(process, signal.SIGTERM)
    assert answers is not None, "the README's block reads no answers with d3stream consume"
    return answers


def _printed_settings_file(printed: str, folder: Path) -> Path:
    """The TOML lines the stack printed (after its "settings file" comment), as a file."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# or as a settings file"))
    end = next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C"))
    path = folder / "printed.toml"
    path.write_text("".join(line + "\n" for line in lines[start:end] if line and not line.startswith("#")))
    return path


def test_the_readme_stream_runs_against_d3stream_stack(tmp_path, qwen35_checkpoint):
    from d3stream.settings import load_settings

    (tmp_path / "examples").symlink_to(REPO / "examples")
    base = _environment()
    env_file = tmp_path / "stack.env"
    out, err = tmp_path / "stack.out", tmp_path / "stack.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        stack = subprocess.Popen([sys.executable, "-m", "d3stream", "stack", "--env-file", env_file.name],
                                 cwd=tmp_path, env=base, stdout=stdout, stderr=stderr)
    try:
        while not env_file.exists():
            assert stack.poll() is None, f"d3stream stack exited with {stack.returncode}:\n{err.read_text()}"
            time.sleep(0.2)
        exported = read_env_file(env_file)
        answers = _run_readme(tmp_path, {**base, **exported}, qwen35_checkpoint)
        through_registry = _run_readme(tmp_path, {**base, **exported}, qwen35_checkpoint, "Schema Registry")
        framed = asyncio.run(_values(exported["D3STREAM_BOOTSTRAP_SERVERS"], "d3.avro-answers"))
    finally:
        status = _stop(stack, signal.SIGINT)

    wanted = {json.loads(line)["id"] for line in REQUESTS.read_text(encoding="utf-8").splitlines() if line.strip()}
    assert {answer["id"] for answer in answers} == wanted
    # The same requests as Avro through the registry: answered alike, in Avro on the topic, read back as JSON.
    assert {answer["id"] for answer in through_registry} == wanted
    assert all("error" not in answer for answer in through_registry), through_registry
    assert len(framed) >= len(wanted) and all(value[:1] == b"\x00" for value in framed)
    for answer in answers:
        assert "error" not in answer, answer
        assert all("error" not in slot for slot in answer["answers"].values()), answer["id"]

    assert status == 0, err.read_text()
    assert not env_file.exists(), "the env file of stopped servers is removed"
    still = [address for address in _addresses(exported) if _accepts(address)]
    assert not still, f"still accepting connections after the stack stopped: {still}"

    printed = out.read_text(encoding="utf-8")
    assert all(f"export {name}=" in printed for name in exported), "the export lines are printed, to paste"
    from_file = load_settings({}, environ={}, config_file=_printed_settings_file(printed, tmp_path))
    from_env = load_settings({}, environ={name: value for name, value in exported.items()
                                          if name.startswith("D3STREAM_")})
    assert from_file == from_env, "the printed settings file says what the export lines say"


async def _values(bootstrap_servers: str, topic: str) -> list[bytes]:
    """Every value on ``topic`` as it was written (committed records only)."""
    from tests.support.stream_helpers import Reader

    async with Reader(bootstrap_servers, topic) as reader:
        await reader.caught_up()
        return [record.value for record in reader.records]


def _start(folder: Path, env_file: Path, *options: str) -> subprocess.Popen:
    """``d3stream stack`` with ``options``; returns once its env file is written (the servers are ready)."""
    env_file.unlink(missing_ok=True)
    with open(folder / "stack.err", "a") as stderr:
        stack = subprocess.Popen([sys.executable, "-m", "d3stream", "stack", "--env-file", str(env_file), *options],
                                 cwd=folder, env=_environment(), stdout=subprocess.DEVNULL, stderr=stderr)
    while not env_file.exists():
        if stack.poll() is not None:
            pytest.fail(f"d3stream stack exited with {stack.returncode}:\n{(folder / 'stack.err').read_text()}")
        time.sleep(0.2)
    return stack


async def _requests_kept(bootstrap_servers: str, expected: int) -> list[bytes]:
    """The keys of the first ``expected`` records of d3.requests, read from the start."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer("d3.requests", bootstrap_servers=bootstrap_servers, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        keys: list[bytes] = []
        while len(keys) < expected:
            batches = await consumer.getmany(timeout_ms=1000)
            keys += [record.key for records in batches.values() for record in records]
        return keys
    finally:
        await consumer.stop()


def test_a_stack_with_a_data_dir_keeps_records_and_objects_across_a_sigterm(tmp_path):
    import boto3

    data, env_file = tmp_path / "data", tmp_path / "stack.env"
    stack = _start(tmp_path, env_file, "--data-dir", str(data), "--no-registry")
    try:
        first = read_env_file(env_file)
        published = subprocess.run([sys.executable, "-m", "d3stream", "produce", "d3.requests", str(REQUESTS)],
                                   env={**_environment(), **first}, capture_output=True, text=True,
                                   timeout=COMMAND_TIMEOUT_S)
        assert published.returncode == 0, published.stderr
        store = boto3.client("s3", endpoint_url=first["D3STREAM_S3_ENDPOINT_URL"], region_name=first["AWS_REGION"],
                             aws_access_key_id=first["AWS_ACCESS_KEY_ID"],
                             aws_secret_access_key=first["AWS_SECRET_ACCESS_KEY"])
        store.put_object(Bucket="d3-media", Key="kept.txt", Body=b"kept")
    finally:
        status = _stop(stack, signal.SIGTERM)
    assert status == 0, (tmp_path / "stack.err").read_text()

    stack = _start(tmp_path, env_file, "--data-dir", str(data), "--no-registry")
    try:
        again = read_env_file(env_file)
        store = boto3.client("s3", endpoint_url=again["D3STREAM_S3_ENDPOINT_URL"], region_name=again["AWS_REGION"],
                             aws_access_key_id=again["AWS_ACCESS_KEY_ID"],
                             aws_secret_access_key=again["AWS_SECRET_ACCESS_KEY"])
        assert store.get_object(Bucket="d3-media", Key="kept.txt")["Body"].read() == b"kept"
        ids = [json.loads(line)["id"].encode() for line in REQUESTS.read_text(encoding="utf-8").splitlines() if line]
        kept = asyncio.run(_requests_kept(again["D3STREAM_BOOTSTRAP_SERVERS"], len(ids)))
        assert sorted(kept) == sorted(ids)
    finally:
        status = _stop(stack, signal.SIGTERM)
    assert status == 0, (tmp_path / "stack.err").read_text()
    assert (data / "kafka").is_dir() and (data / "s3").is_dir(), "--data-dir is kept after the stack stops"
