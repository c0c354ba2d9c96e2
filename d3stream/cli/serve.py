"""``d3stream serve``: one worker. Its settings come from flags, ``D3STREAM_*`` variables and a TOML file;
its models are loaded (s3:// ones fetched and verified) after the metrics endpoint is up, so a liveness probe
sees a live process meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d3stream.runtime import D3
    from d3stream.settings import Settings

from d3stream.cli.common import WORKER_FATAL_EXIT, Refused, checkpoint_folder, load_checkpoint, reach_kafka
from d3stream.cli.shape import Command


def _serve(args: argparse.Namespace) -> int:
    from d3stream.kafka.connection import check_connection
    from d3stream.ops.logs import configure_logging
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
        check_connection(settings.connection)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    configure_logging(settings.observability.log_format, settings.observability.log_level)
    if not settings.models.checkpoints and not settings.models.model_source:
        raise Refused("no checkpoint: set --model (or --model-source), D3STREAM_MODEL or model = ... in the "
                      "settings file")
    from d3stream.models.checkpoints import CheckpointError
    from d3stream.ops.metrics import Metrics, serve_metrics
    from d3stream.service import Service

    # The endpoint comes up before the models are downloaded and loaded, so a liveness probe sees a live
    # process meanwhile.
    metrics = Metrics()
    server = serve_metrics(metrics, settings.observability)
    try:
        # Kafka is asked once the checkpoints are found and checked, before the seconds their loading takes: a
        # wrong address or password should not wait for it, a wrong checkpoint is said whether Kafka answers or not.
        models, shadow = _load_models(settings, ready_to_load=lambda: reach_kafka(settings))
        service = Service(settings, models, metrics=metrics, shadow=shadow)
    except (CheckpointError, ValueError) as exc:  # also: two models of one name, prefix_reuse=on on a non-causal one
        if server is not None:
            server.stop()
        raise Refused(str(exc)) from exc
    except BaseException:
        if server is not None:
            server.stop()
        raise
    _log_kernel_notice([*models, *([shadow] if shadow is not None else [])])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, service.stop)
        try:
            await service.run()
        finally:
            # A start-up step that failed (Kafka gone since reach_kafka) leaves the consumer made but never
            # started: closed here, so no "Unclosed AIOKafkaConsumer" follows the error's one line.
            if service.consumer is not None:
                await service.consumer.stop()

    from d3stream.kafka.limits import WorkerFatal

    try:
        asyncio.run(main())
    except WorkerFatal as exc:  # e.g. no permission on the answer topic: a restart would not help by itself
        import structlog

        # A log line like every other (JSON with --log-format json), not a bare print.
        structlog.get_logger("d3stream.serve").error("d3stream serve stopped", error=str(exc),
                                                     exit_status=WORKER_FATAL_EXIT)
        return WORKER_FATAL_EXIT
    finally:
        if server is not None:
            server.stop()
    return 0


def _log_kernel_notice(models: list[D3]) -> None:
    """Say once, at ``info``, when the models run transformers' reference Gated DeltaNet kernels: the logging
    set-up puts transformers' own warnings about it at ``debug`` (ops/logs.py)."""
    import structlog

    from d3stream.ops.logs import kernel_notice

    notices = dict.fromkeys(kernel_notice(model.kernel_record(), str(model.device)) for model in models)
    for notice in notices:
        if notice:
            structlog.get_logger("d3stream.serve").info(notice)


def _load_models(settings: Settings, ready_to_load: Callable[[], object] = lambda: None) -> tuple[list[D3], D3 | None]:
    """Every ``--model`` of serve, the first the default, and a ``--shadow NAME=PATH`` checkpoint (None: no
    shadow, or a served model's name): made local (s3:// fetched and verified), their weights checked to fit
    the device together (``model_memory_bytes``) before any is loaded, then loaded (and warmed up with
    ``warmup``). With ``model_source`` its pointer's current checkpoint (and canary) come first, the default
    (rollout.py), loaded and verified as one step. ``ready_to_load`` runs just before the ``--model``
    checkpoints load (the seconds of a start). CheckpointError / ValueError / Refused name what is wrong."""
    from d3stream.models.checkpoints import (
        check_models_fit,
        checkpoint_memory_bytes,
        model_name_for,
        parse_model_specs,
        resolve_model,
    )
    from d3stream.models.shadow import parse_shadow

    specs = parse_model_specs(settings.models.checkpoints)  # a name given twice is refused before any download
    shadow_text = settings.models.shadow
    shadow = parse_shadow(shadow_text) if shadow_text else None
    texts = list(settings.models.checkpoints)
    if shadow_text and shadow is not None and shadow.location is not None:  # its own checkpoint: loaded alike
        specs.append(parse_model_specs([shadow_text])[0])
        texts.append(shadow_text)
    resolved = [resolve_model(text, settings.storage) for text in texts]
    for index, (text, each) in enumerate(zip(texts, resolved, strict=True)):  # a typo is said before Kafka is asked
        checkpoint_folder(each.path, text, "--model" if index < len(settings.models.checkpoints) else "--shadow")
    names: list[str | None] = [each.name for each in resolved]
    if settings.models.checkpoints and not settings.models.model_source:  # model_name names the default; a source's names itself
        names[0] = model_name_for(resolved[0], settings.models.model_name)
    device = settings.models.device or ("cuda:0" if _cuda_available() else "cpu")
    check_models_fit({name or spec.location: checkpoint_memory_bytes(each.path)
                      for name, spec, each in zip(names, specs, resolved, strict=True)},
                     device, settings.models.model_memory_bytes)
    models: list[D3] = []
    if settings.models.model_source:
        from d3stream.models.rollout import load_source_models

        models.extend(load_source_models(settings.models, settings.storage,
                                         beside=[each.path for each in resolved]))
    ready_to_load()
    for name, each in zip(names, resolved, strict=True):
        models.append(load_checkpoint(each.path, device=settings.models.device, verify=settings.models.verify,
                                      model_name=name, permutation_average=settings.models.permutation_average))
    if settings.models.warmup:
        for model in models:
            model.warmup()
    if len(texts) > len(settings.models.checkpoints):  # the last one loaded is the shadow's checkpoint
        return models[:-1], models[-1]
    return models, None


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import add_arguments as add_settings

    add_settings(parser)


COMMAND = Command("serve", "run the service: answer requests from Kafka", add_arguments, _serve)
