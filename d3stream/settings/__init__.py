"""A worker's settings: typed sections (sections.py), their catalogue by written name (catalog.py), the three
places an operator writes them (sources.py: flags, ``D3STREAM_*`` variables, a TOML file) and the page that
documents them (reference.py). Secrets never print (secret.py).

The bottom layer beside the runtime: it imports nothing of d3stream outside itself.
"""

import os
from pathlib import Path

from d3stream.settings.catalog import SECTIONS, SETTINGS, Setting, Settings
from d3stream.settings.secret import Secret
from d3stream.settings.sections import (
    BatchingSettings,
    ConnectionSettings,
    DeliveryName,
    DeliverySettings,
    EvaluationSettings,
    LifecycleSettings,
    LimitSettings,
    MediaSettings,
    ModelSettings,
    ObservabilitySettings,
    Ordering,
    RecordFormat,
    RegistrySettings,
    StorageSettings,
    SubjectNameStrategy,
)
from d3stream.settings.sources import (
    CONFIG_ENV,
    CONNECTION_FIELDS,
    ENV_PREFIX,
    add_arguments,
    env_name,
    flag_name,
    load_settings,
)

# Where d3stream keeps what it builds or downloads (tokenizers, demo checkpoints, downloaded models).
CACHE_ENV = "D3STREAM_CACHE"


def cache_root() -> Path:
    """``$D3STREAM_CACHE`` or ``~/.cache/d3stream``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "d3stream"


# The heartbeat unless set: aiokafka's 3 s. A member hears of a rebalance at its next heartbeat, and until the last
# member has heard, every member's partitions stand still; a second instead did not shorten bench fleet's pauses
# beyond its noise (2.4-2.6 s per worker over a rolling restart, against 2.5-2.7 at 3 s: docs/MEASUREMENTS.md).
DEFAULT_HEARTBEAT_MS = 3000


def heartbeat_interval_ms(delivery: DeliverySettings) -> int:
    """The setting, or 3 s, or a third of a shorter session timeout, so one late heartbeat does not drop a
    healthy worker from the group."""
    if delivery.heartbeat_interval_ms is not None:
        return delivery.heartbeat_interval_ms
    return min(DEFAULT_HEARTBEAT_MS, delivery.session_timeout_ms // 3)


__all__ = [
    "CACHE_ENV", "CONFIG_ENV", "CONNECTION_FIELDS", "ENV_PREFIX", "SECTIONS", "SETTINGS",
    "BatchingSettings", "ConnectionSettings", "DeliveryName", "DeliverySettings", "EvaluationSettings",
    "LifecycleSettings", "LimitSettings", "MediaSettings", "ModelSettings", "ObservabilitySettings", "Ordering",
    "RecordFormat", "RegistrySettings", "Secret", "Setting", "Settings", "StorageSettings", "SubjectNameStrategy",
    "add_arguments", "cache_root", "env_name", "flag_name", "heartbeat_interval_ms", "load_settings",
]
