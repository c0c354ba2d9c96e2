"""Model routing: which of a worker's served models answers a request.

A worker may serve several models at once (``serve --model`` repeated, a rollout's canary, a swap in
progress), each a ``Hosted`` with parts of its own. ``Router.route`` decides, once per request and at
admission, which one answers it:

* the request's ``model`` field, when it names one: that model, if requests may be routed to it (served and
  not retired); else the request is refused as ``model_not_served``. A caller that names a model is not
  given another's answer, which would differ from the one it asked for and say so only in its provenance;
* a request that names none: the model ``route_default`` picks (set by the rollout: its canary share, by a
  hash of the request id, so every worker, restart and replay picks the same one; ``models/rollout.py``),
  else the default, the first model served.

Why once, at admission: from then on the request uses only its model's parts (its prepare, its passes, its
answer builder, its provenance digest, from which its answer id is derived), so no request is prepared for
one model and scored by another, and a swap (``add``, ``retire``) changes only where requests admitted after
it go. A retired model takes no new requests but stays in ``hosted`` until it has answered those already
routed to it (``RequestRecord.model`` names it until then): ``drop`` forgets it once the ledger counts none.
What is refused before it is routed (undecodable, an unknown model, expired at read) is answered with the
default model's records.

The router is the one owner of the served models: the worker (``service/``) and the rollout ask it which
models are served and which is the default, and keep no list of their own. A model loaded while serving is
``host``-ed here before anything is routed to it (its provenance is published first), so that ``every`` names
each model whose parts are open, routed or not yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from d3stream_client.contract import Request

from d3stream.core.answers import AnswerBuilder
from d3stream.core.passes import Passes
from d3stream.core.record import Refusal, RequestRecord
from d3stream.core.seams import DecisionModel


@dataclass(eq=False)
class Hosted:
    """One model a worker serves, with what is its own: its passes (row and shared-prefix schedulers, token
    budget, prefix runner; the model thread is shared), its answer builder (model record), its provenance
    record and that record's digest, which its answer ids are derived from."""

    model: DecisionModel
    passes: Passes
    answers: AnswerBuilder
    provenance: dict[str, object]  # a JSON object: digested and published as it is
    provenance_sha256: str

    @property
    def name(self) -> str:
        return self.model.model_name


class Router:
    """The models of one worker and which one each request goes to (see the module's docstring).

    ``routed`` is the in-flight ledger's count of each model's unanswered requests (``InFlightLedger.routed``):
    the router reads it, and only ``drop`` removes a model's entry, when it has reached zero."""

    def __init__(self, hosted: Sequence[Hosted], *, routed: Counter[str]):
        self.hosted = {each.name: each for each in hosted}
        if len(self.hosted) != len(hosted):
            raise ValueError("two served models have the same name: name them with --model NAME=PATH")
        # What requests may name: the models above less any retired one that still answers what it holds.
        self.routes = dict(self.hosted)
        self.default = hosted[0]
        # Picks the model of a request that names none (None: the default); set by a rollout's canary.
        self.route_default: Callable[[Request], Hosted] | None = None
        self.routed = routed
        # Models loaded while serving and not routed to yet (a swap's checkpoint until ``add``).
        self.loading: list[Hosted] = []

    @property
    def every(self) -> list[Hosted]:
        """Every model hosted: the routable ones, the retired ones still answering, those not routed to yet."""
        return [*self.hosted.values(), *self.loading]

    def route(self, request: Request) -> Hosted | Refusal:
        """The model a decoded request goes to, or its ``model_not_served`` refusal."""
        if request.model is not None:
            hosted = self.routes.get(request.model)
        else:
            hosted = self.default if self.route_default is None else self.route_default(request)
        if hosted is None:
            served = ", ".join(repr(name) for name in self.routes)
            return Refusal("model_not_served", f"this worker serves {served}, not {request.model!r}")
        return hosted

    def of(self, record: RequestRecord) -> Hosted:
        """The model a request was routed to (the default before routing, and for what is refused before it)."""
        return self.default if record.model is None else self.hosted[record.model]

    def host(self, hosted: Hosted) -> None:
        """A model loaded while serving: hosted, but nothing is routed to it until ``add``."""
        self.loading.append(hosted)

    def unhost(self, hosted: Hosted) -> None:
        """Forget a model hosted and never routed to (a swap refused after it loaded)."""
        self.loading = [each for each in self.loading if each is not hosted]

    def add(self, hosted: Hosted, *, default: bool = False) -> None:
        """Serve one more model (or serve a retired one again); as the default, requests naming none go to it."""
        self.unhost(hosted)
        self.hosted[hosted.name] = self.routes[hosted.name] = hosted
        if default:
            self.default = hosted

    def retire(self, name: str) -> None:
        """Route nothing more to ``name``; what was routed to it is still answered by it."""
        self.routes.pop(name, None)

    def drop(self, name: str) -> Hosted | None:
        """Forget a retired model that holds no request any more (None: it still holds some, or is routable)."""
        if name in self.routes or self.routed[name] > 0:
            return None
        del self.routed[name]
        return self.hosted.pop(name, None)
