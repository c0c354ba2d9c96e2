"""Shared fixtures: real servers (tests/infra_fixtures.py) and tiny checkpoints built on demand."""

pytest_plugins = ["tests.infra_fixtures", "tests.model_fixtures", "tests.stream_helpers"]
