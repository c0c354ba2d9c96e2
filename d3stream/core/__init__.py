"""The request pipeline, with no Kafka in it: a request record in, one answer event out.

Events and their validation, media (references, fetching, decoding, budgets), admission and quotas, the
prepare thread, the row scheduler and its passes, answers and their size fit, shadow answers. It sees the
model through one protocol (``seams.DecisionModel``) and the outside world through values it returns:
whatever reads and writes Kafka lives a layer up, in ``d3stream.kafka``.
"""
