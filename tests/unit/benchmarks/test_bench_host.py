"""The stand-in backbone of ``d3stream bench host`` (d3stream/benchmarks/bench_host.py) in a real model: the runtime's
full-prompt, shared-prefix and media paths run through it, and it records what a device would have been given."""

from __future__ import annotations

import pytest

from d3stream.benchmarks.bench_host import (
    DeviceLog,
    StandInBackbone,
    cpu_by_stage,
    install_stand_in,
    take_sample,
)
from tests.support.model_fixtures import load_model

QUESTIONS = {"late": {"type": "noul", "instructions": "Did it arrive late?"},
             "what": {"type": "choice", "criteria": {"refund": "pay back", "resend": "send again"}}}

# Its module-scoped model loads once, on one pytest worker (xdist_group, make test's --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bench-host-model")


@pytest.fixture(scope="module")
def stood_in(qwen35_checkpoint):
    """A model of its own (the session's are shared) with a stand-in of 2 ms a call."""
    model = load_model(qwen35_checkpoint, device="cpu")
    return model, install_stand_in(model, device_ms=2.0)


def test_full_prompts_are_answered_through_the_stand_in(stood_in):
    model, stand_in = stood_in
    stand_in.log = DeviceLog()
    answer = model.system_one(state="The parcel arrived a week late.", questions=QUESTIONS)
    # zero hidden states read out through the real readout: every option equally likely
    assert answer["answers"]["late"]["probabilities"] == {"false": 0.5, "true": 0.5}
    assert answer["answers"]["what"]["probabilities"] == {"refund": 0.5, "resend": 0.5}
    [(kind, real, padded, started, ended)] = stand_in.log.calls
    assert kind == "full" and real == answer["usage"]["input_tokens"] and padded >= real
    assert ended - started >= 0.002  # the device time was slept


def test_shared_prefix_passes_run_on_the_stand_in_cache(stood_in):
    """The prefix pass gets its cache filled with states of the real shapes, so the suffix pass stacks them."""
    from d3stream.runtime.prefix import PrefixRunner

    model, stand_in = stood_in
    stand_in.log = DeviceLog()
    prepared = model.prepare("The parcel arrived a week late and the box was open. " * 20, QUESTIONS)
    runner = PrefixRunner(model, verify_every=1)
    probabilities = runner.run([prepared])
    assert sorted(len(values) for values in probabilities.values()) == [2, 2]
    kinds = [call[0] for call in stand_in.log.calls]
    assert kinds[:2] == ["prefix", "suffix"] and set(kinds[2:]) == {"full"}  # then the exact-replay checks
    assert runner.report()["rows_reused"] == 2 and runner.report()["failed_checks"] == 0


def test_images_get_zero_features_of_the_merged_size(stood_in):
    from PIL import Image

    model, stand_in = stood_in
    stand_in.log = DeviceLog()
    answer = model.system_one(state="A photo of the parcel.", questions=QUESTIONS,
                              images=[Image.new("RGB", (448, 336), (90, 120, 30))])
    assert answer["answers"]["late"]["probabilities"] == {"false": 0.5, "true": 0.5}
    assert stand_in.log.vision_calls == 1 and [call[0] for call in stand_in.log.calls] == ["full"]


def test_stand_in_is_not_stacked_and_keeps_the_real_backbone(stood_in):
    model, stand_in = stood_in
    again = install_stand_in(model)
    assert isinstance(again, StandInBackbone) and again.real is stand_in.real
    assert model.checkpoint.backbone is again and again.config is stand_in.real.config
    install_stand_in(model, device_ms=2.0).log = DeviceLog()  # as the module's fixture had it


def test_cpu_by_stage_groups_threads_by_the_worker_names():
    import threading
    import time

    before = take_sample({})
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # 50 ms of its own CPU (a few clock ticks), however busy the machine, then it waits
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            sum(range(1000))
        spun.set()
        done.wait()

    worker = threading.Thread(target=spin, name="d3stream-prepare_0")
    worker.start()
    try:
        spun.wait()
        after = take_sample({})
    finally:
        done.set()
        worker.join()
    spent = cpu_by_stage(before, after, threading.get_native_id())
    assert set(spent) == {"event_loop", "prepare", "model_thread", "fetch_threads", "decode_threads",
                          "decode_processes", "native_threads", "other"}
    assert all(value >= 0 for value in spent.values())
    assert spent["prepare"] > 0  # the spinning thread, found by its name
