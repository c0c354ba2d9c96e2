"""Which checkpoints a worker serves: where they come from and how they are verified (``checkpoints``), and
how a served model is swapped without a stop or shares traffic with a canary (``rollout``)."""
