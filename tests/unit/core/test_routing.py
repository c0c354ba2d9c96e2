"""Model routing (d3stream/core/routing.py) on its own: a named model, the canary's pick, the default, a name
not served, and a retired model kept until nothing routed to it is in flight. The routing of whole requests
through a worker is tested in tests/test_multimodel.py and tests/test_rollout.py."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from d3stream_client.contract import Request

from d3stream.core.record import Refusal
from d3stream.core.routing import Hosted, Router


def _hosted(name: str) -> Hosted:
    none: Any = None  # routing reads the name only
    return Hosted(SimpleNamespace(model_name=name), none, none, {}, "")


def _request(model: str | None = None) -> Request:
    return Request(id="r1", state="s", questions={}, model=model)


def test_a_named_model_a_canary_pick_or_the_default() -> None:
    v1, v2 = _hosted("v1"), _hosted("v2")
    router = Router([v1, v2], routed=Counter())
    assert router.route(_request("v2")) is v2
    assert router.route(_request()) is v1
    router.route_default = lambda request: v2
    assert router.route(_request()) is v2
    assert router.route(_request("v1")) is v1  # a named model is not the canary's to pick


def test_a_name_not_served_is_refused() -> None:
    router = Router([_hosted("v1")], routed=Counter())
    refusal = router.route(_request("v9"))
    assert isinstance(refusal, Refusal) and refusal.code == "model_not_served"
    assert refusal.message == "this worker serves 'v1', not 'v9'"


def test_two_models_of_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="same name"):
        Router([_hosted("v1"), _hosted("v1")], routed=Counter())


def test_a_retired_model_answers_what_it_holds_and_is_dropped_when_it_holds_none() -> None:
    v1, v2 = _hosted("v1"), _hosted("v2")
    routed: Counter[str] = Counter({"v1": 1})
    router = Router([v1], routed=routed)
    router.add(v2, default=True)
    router.retire("v1")
    assert router.route(_request()) is v2
    assert isinstance(router.route(_request("v1")), Refusal)
    assert router.of(SimpleNamespace(model="v1")) is v1  # still answers its request
    assert router.drop("v1") is None  # one still in flight
    routed["v1"] -= 1
    assert router.drop("v1") is v1 and "v1" not in router.hosted and "v1" not in routed
    assert router.drop("v2") is None  # routable: never dropped


def test_a_model_loaded_while_serving_is_hosted_before_it_is_routed_to() -> None:
    """The router is the one owner of the served models: ``every`` names each model whose parts are open, one
    loaded for a swap too, before anything is routed to it; ``add`` routes it, ``unhost`` forgets a refused one."""
    v1, v2, v3 = _hosted("v1"), _hosted("v2"), _hosted("v3")
    router = Router([v1], routed=Counter())
    router.host(v2)
    router.host(v3)
    assert router.every == [v1, v2, v3]
    assert isinstance(router.route(_request("v2")), Refusal)  # not routed to yet
    router.add(v2, default=True)
    assert router.every == [v1, v2, v3] and router.default is v2 and router.loading == [v3]
    router.unhost(v3)  # the swap that loaded it was refused
    assert router.every == [v1, v2]
