"""Production jobs beside the worker: replaying a request topic through a model (``replay``), comparing answer
sets with each other and with labels (``compare``), and live evaluation's command (``evaluate``). Each runs
against a real cluster; they share compare's readers of Kafka ranges and answer files."""
