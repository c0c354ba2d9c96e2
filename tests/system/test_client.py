"""The client distribution (clients/python, ``d3stream_client``) in processes of its own.

* It installs alone into a fresh venv, small, and importing all of it loads no model library; beside the
  worker it loads none either, nor the ``[registry]`` extra's libraries until a ``RegistryFormat`` is named,
  and the contract alone loads no Kafka client (fresh interpreters).
* A subscriber reading across a SIGKILLed ``at_least_once`` worker hands each answer to its loop once,
  and commits only what the loop finished with.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from d3stream_client import (
    D3Client,
)

from d3stream.benchmarks.chaos import WorkerProcess, worker_env
from tests.support.stream_helpers import Q_NOUL, Reader, committed, run

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "python"
MODEL_LIBRARIES = ("torch", "torchvision", "transformers", "numpy", "cv2", "PIL", "d3stream")


def _client(stack, **options) -> D3Client:
    return D3Client(stack.broker.bootstrap_servers, request_topic=stack.requests, answer_topic=stack.answers,
                    worker_group=stack.group, **options)


# ------------------------------------------------------------------------------------ the distribution


def test_the_client_installs_alone_small_and_imports_no_model_library(tmp_path):
    folder = tmp_path / "venv"
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    before = _size(folder)
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(CLIENT)], check=True, timeout=600)
    installed_mb = (_size(folder) - before) / 1e6
    print(f"\n[client install] {installed_mb:.1f} MB beside pip in a fresh venv")
    assert installed_mb < 60, f"the client and its dependencies take {installed_mb:.1f} MB"
    probe = (
        "import sys, d3stream_client\n"
        "from d3stream_client import *\n"
        "import d3stream_client.media, d3stream_client.schemas\n"
        f"print([name for name in {MODEL_LIBRARIES!r} if name in sys.modules])\n"
    )
    shown = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "[]"


def test_importing_the_client_beside_the_worker_loads_no_model_library():
    """In the worker's own venv, where torch is installed, nothing of the client pulls it in."""
    probe = (
        "import sys\n"
        "from d3stream_client import *\n"
        "from d3stream_client import D3Client, Publisher, AnswerSubscription, AnswerWaiter\n"
        "import d3stream_client.media, d3stream_client.schemas\n"
        f"print([name for name in {MODEL_LIBRARIES!r} if name in sys.modules])\n"
    )
    shown = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "[]"


def test_the_client_loads_nothing_of_the_registry_extra_until_a_registry_is_configured():
    """confluent-kafka and fastavro are installed here (the worker needs them), yet importing the client, all of
    it, loads neither; naming ``RegistryFormat`` does."""
    probe = (
        "import sys\n"
        "import d3stream_client\n"
        "from d3stream_client import *\n"
        "from d3stream_client import D3Client, Publisher, AnswerSubscription, AnswerWaiter, consume_answers\n"
        "import d3stream_client.schemas, d3stream_client.avro\n"
        "print([name for name in ('confluent_kafka', 'fastavro') if name in sys.modules])\n"
        "from d3stream_client import RegistryFormat\n"
        "print([name for name in ('confluent_kafka', 'fastavro') if name in sys.modules])\n"
    )
    shown = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert shown.stdout.split("\n")[:2] == ["[]", "['confluent_kafka', 'fastavro']"]


def test_the_contract_alone_loads_no_kafka_client():
    probe = "import sys, d3stream_client.contract, d3stream_client.validation\nprint('aiokafka' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "False"


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


# -------------------------------------------------------------------------------------- subscribing


def test_a_subscriber_across_a_worker_sigkill_hands_each_answer_to_its_loop_once(stack, qwen35_checkpoint, tmp_path):
    """at_least_once repeats answers after a SIGKILL (a slow commit makes sure of it); the subscription drops
    the repeats, and its group's committed offsets cover only answers its loop finished with."""
    ids = [f"sub-{n}" for n in range(60)]
    env = worker_env({
        "bootstrap_servers": stack.broker.bootstrap_servers, "request_topics": [stack.requests],
        "answer_topic": stack.answers, "dead_letter_topic": stack.dead_letters,
        "provenance_topic": stack.provenance, "group_id": stack.group,
        "group_instance_id": f"{stack.group}-0", "session_timeout_ms": 6000, "model": str(qwen35_checkpoint),
        "delivery": "at_least_once", "commit_interval_ms": 60_000, "metrics_port": "", "log_format": "json",
    })
    env.pop("D3STREAM_CONFIG", None)
    worker = WorkerProcess(env, tmp_path / "worker.log")
    subscriber_group = stack.unique("subscriber")

    async def scenario() -> tuple[list[tuple[str, str]], int, int, dict[int, int]]:
        handed: list[tuple[str, str]] = []
        async with _client(stack) as client, client.answers(subscriber_group) as subscription, \
                Reader(stack.broker.bootstrap_servers, stack.answers) as topic:
            worker.start()
            try:
                await client.publish_many([{"id": i, "questions": {"q": Q_NOUL}} for i in ids[:30]])
                async for answer in subscription:
                    handed.append((answer.id, answer.answer_id))
                    if len(handed) == 30:
                        break
                worker.kill()  # nothing committed (commit_interval_ms 60 s): the restart answers all 30 again
                worker.start()
                await topic.wait(lambda: len(topic.records) >= 60, 120, what="the first 30 answers again")
                # Published after the repeats are on the topic, so each partition's repeats come before its
                # new answers: when the loop has every id, it has also passed every repeat.
                await client.publish_many([{"id": i, "questions": {"q": Q_NOUL}} for i in ids[30:]])
                async for answer in subscription:
                    handed.append((answer.id, answer.answer_id))
                    if len(handed) == len(ids):
                        break
            finally:
                assert worker.terminate(60) == 0, worker.log_path.read_text()[-3000:]
            await topic.caught_up()
            repeats, on_topic = subscription.repeats, len(topic.records)
        return handed, repeats, on_topic, await committed(stack.broker.bootstrap_servers, subscriber_group,
                                                          stack.answers, 4)

    handed, repeats, on_topic, offsets = run(scenario())
    assert sorted(request_id for request_id, _ in handed) == sorted(ids), "each request's answer reached the loop once"
    assert len({answer_id for _, answer_id in handed}) == len(ids)
    assert on_topic == 90 and repeats == 30, (on_topic, repeats)
    # The loop broke out on its last answer before finishing with it: that one alone is not committed.
    assert sum(offsets.values()) == on_topic - 1
