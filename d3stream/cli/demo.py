"""``d3stream demo``: the embedded default, end to end (dev/demo.py runs it; this prints what it found)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from d3stream.cli.shape import Command

if TYPE_CHECKING:
    from d3stream.dev.demo import LiveFigures, Reevaluation


def _brief(value: object) -> str:
    """One answer slot as a short text: the choice with its probability, p(true), the score, or the error."""
    assert isinstance(value, dict)  # the service answers each question with an object
    if "error" in value:
        return value["error"]
    if value.get("type") == "choice":
        return f"{value['choice']} ({value['probabilities'][value['choice']]:.2f})"
    if value.get("type") == "noul":
        return f"p(true) {value['noul']:.2f}"
    return f"{value.get('score', 0):.2f} of {len(value.get('probabilities') or {}) - 1}"


def _request_id(answer: Mapping[str, object]) -> str:
    request_id = answer["id"]
    assert isinstance(request_id, str)  # an answer record names its request
    return request_id


def _answer_line(answer: Mapping[str, object]) -> str:
    """An answer record in brief: its error's code, or each question's answer."""
    error, slots = answer.get("error"), answer.get("answers") or {}
    if error:
        assert isinstance(error, dict)  # the error object: code and message
        return str(error["code"])
    assert isinstance(slots, dict)  # answers by question id
    return "  ".join(f"{key}: {_brief(value)}" for key, value in slots.items())


def _print_reevaluation(figures: Reevaluation) -> None:
    trained, baseline = figures["checkpoints"]
    print(f"\nre-evaluation: the {figures['labelled']} labelled questions replayed through a second checkpoint"
          f" and compared with their labels (as `d3stream compare --labels` does)")
    print(f"{'checkpoint':<36}{'accuracy':>10}{'Brier':>8}{'ECE':>8}")
    for index, name in enumerate((trained, baseline)):
        print(f"{name:<36}{figures['accuracy'][index]:>10.3f}{figures['brier'][index]:>8.3f}"
              f"{figures['ece'][index]:>8.3f}")
    print(f"better: {figures['better']} (the two agree on {figures['agreement']:.0%} of the decisions)")


def _print_live_evaluation(live: LiveFigures, offline: Reevaluation, same: bool) -> None:
    """The live evaluation (d3stream evaluate) of the served checkpoint beside its offline re-evaluation (the
    two must agree: the same answers and labels)."""
    served = offline["checkpoints"][0]
    model = next((m for m in live["models"] if m["model"] == served and m["role"] == "live"), None)
    print(f"\nlive evaluation: d3stream evaluate joined {live['evaluations']} answers with labels that came before "
          "and after them")
    print(f"{'':<36}{'accuracy':>10}{'Brier':>8}{'ECE':>8}{'log loss':>10}")
    if model is None:
        print("no live evaluation of the served checkpoint")
        return
    print(f"{'live (d3stream evaluate)':<36}{model['accuracy']:>10.3f}{model['brier']:>8.3f}{model['ece']:>8.3f}"
          f"{model['log_loss']:>10.3f}")
    print(f"{'offline (compare --labels)':<36}{offline['accuracy'][0]:>10.3f}{offline['brier'][0]:>8.3f}"
          f"{offline['ece'][0]:>8.3f}{offline['log_loss'][0]:>10.3f}")
    print("the same figures, live and offline" if same else "the live and offline figures differ")


def _say_to_stderr(progress: bool) -> Callable[[str], None]:
    """The demo's step lines on stderr, a terminal or not (a CI log, ``| tee``), flushed at once; above the
    answers' progress bar while one is drawn."""

    def say(line: str) -> None:
        if progress:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    return say


def _demo(args: argparse.Namespace) -> int:
    from d3stream.dev.demo import run_demo
    from d3stream.dev.infra import InfraError
    from d3stream.ops.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    progress = not args.json and sys.stderr.isatty()
    try:
        summary = asyncio.run(run_demo(progress=progress, timeout_s=args.timeout, say=_say_to_stderr(progress)))
    except InfraError as exc:  # a local server that would not start: its log's path and tail say why
        print(f"d3stream demo: {exc}", file=sys.stderr)
        return 1
    answers = summary["answers"]
    labelled = set(summary["labelled_ids"])
    if args.json:  # the summary without the answers and the labelled ids
        print(json.dumps({key: value for key, value in summary.items() if key not in ("answers", "labelled_ids")}))
    else:
        from d3stream.dev.tasks import showcase

        texts = {e.id: e.request["state"]["text"] for e in showcase() if isinstance(e.request["state"], dict)}
        shown = [a for a in answers if not _request_id(a).startswith("heldout-")]
        for answer in sorted(shown, key=_request_id):
            request_id = _request_id(answer)
            if request_id in texts:
                print(f"{request_id:<20} \"{texts[request_id]}\"")
            print(f"{request_id:<20} {_answer_line(answer)}")
        held = len([a for a in answers if _request_id(a).startswith("heldout-")])
        print(f"(and {held} requests drawn from the held-out set; {len(labelled)} labelled requests in all)")
        _print_reevaluation(summary["reevaluation"])
        _print_live_evaluation(summary["live_evaluation"], summary["reevaluation"], summary["live_equals_offline"])
        print(f"\npublished {summary['published']} ({summary['framed']} framed as Avro through the Schema Registry), "
              f"answered {summary['answered']}, error answers "
              f"{summary['errors']}, dead letters {summary['dead_letters']}, replayed {summary['replayed']}, "
              f"{summary['seconds']} s")
        print("time of each step (s): " + ", ".join(f"{name} {seconds}" for name, seconds
                                                    in summary["step_seconds"].items()))
    every = summary["answered"] == summary["published"] == summary["replayed"]
    return 0 if every and summary["live_equals_offline"] else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all answers")


COMMAND = Command("demo", "run everything locally: broker, object store, a tiny trained model, sample requests, "
                  "and a labelled re-evaluation against a random checkpoint", add_arguments, _demo)
