"""Measurements: one module per benchmark (``d3stream bench``: the batching paths, the Kafka path, memory soaks,
the client's wait, live evaluation, ordering, scheduling, the mixed stream) and the reliability reports (the
chaos kill cycles and the scale-out runs). Speed claims live here, never in a test. (The repository's
``bench/`` holds the prepared GPU run, ``bench/gpu.sh``, and two one-off studies: bench/README.md.)"""
