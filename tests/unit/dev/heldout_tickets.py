"""Support tickets written apart from the demo task's templates, with their labels: the held-out wordings.

``d3stream/dev/tasks.py`` generates the demo checkpoint's training tickets from templated sentences; a
checkpoint that learned those templates and not the task answers its own held-out draw right and a newcomer's
sentence wrong (issue 43: the README's "The export button throws an error ... our whole team is blocked"
routed to billing). These tickets were written by hand, before the templates were extended, by someone
phrasing support requests as customers do (polite and curt, with greetings, asides, amounts and distractors,
money mentioned without asking for it back), not by filling the templates. No sentence here is a template's.

Each ticket is labelled for the demo task's three questions: ``team`` (billing, tech, sales), ``refund`` (does
the customer ask for their money back) and ``urgency`` (the level index: 0 low, it can wait; 1 medium, nothing
said or this week; 2 high, today, blocked, critical). ``tests/unit/dev/test_heldout_wordings.py`` asks the demo checkpoint
and holds it to a floor; the showcase tickets of the demo and the README's ``examples/requests.jsonl`` must be
answered right, all of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from d3stream.dev import tasks

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "requests.jsonl"

LOW, NORMAL, URGENT = 0, 1, 2


class Labelled(NamedTuple):
    """A ticket's text and its three labels."""

    text: str
    team: str
    refund: bool
    urgency: int


WORDINGS: tuple[Labelled, ...] = (
    # billing
    Labelled("Hi, I see two identical charges of $29 on my credit card from you. Can you reimburse one of them? "
             "Thanks.", "billing", True, NORMAL),
    Labelled("Our invoice for March lists 12 users but we only have 9. Please correct it when you have time, no "
             "rush.", "billing", False, LOW),
    Labelled("You took the payment again after I cancelled my account last week. I want my money back right now, "
             "this is critical.", "billing", True, URGENT),
    Labelled("Where can I download the receipts for last year's payments?", "billing", False, NORMAL),
    Labelled("The VAT number is missing on my invoice. Could you add it?", "billing", False, NORMAL),
    Labelled("I was charged for the annual plan instead of the monthly one. Please refund the difference.",
             "billing", True, NORMAL),
    Labelled("My bank shows a charge from you that I don't recognise. Charge it back please, asap.",
             "billing", True, URGENT),
    Labelled("Please update the billing address on our account. Whenever you can.", "billing", False, LOW),
    Labelled("The renewal fee was taken twice from our company card. We need the extra payment refunded today.",
             "billing", True, URGENT),
    Labelled("Can you tell me why my last invoice is higher than usual?", "billing", False, NORMAL),
    Labelled("Hello, my payment keeps getting declined even though the card is valid. Please help urgently.",
             "billing", False, URGENT),
    Labelled("I'd like a refund for the unused months of my subscription. No hurry.", "billing", True, LOW),
    Labelled("We were billed in dollars but our contract is in euros. Please fix the invoice.", "billing", False,
             NORMAL),
    Labelled("The charge on my statement is correct, I just need a receipt for my expenses. Low priority.",
             "billing", False, LOW),
    Labelled("I paid $50 yesterday but still have no invoice.", "billing", False, NORMAL),
    # tech
    Labelled("The app crashes as soon as I tap the settings icon. Not urgent, just letting you know.", "tech",
             False, LOW),
    Labelled("I keep getting error 403 when I upload a file. Our whole office is blocked, please help asap!",
             "tech", False, URGENT),
    Labelled("Login with Google is broken since yesterday.", "tech", False, NORMAL),
    Labelled("There is a bug in the search: it returns no results for names with accents. Whenever you have "
             "time.", "tech", False, LOW),
    Labelled("The dashboard does not load at all and we have a demo in an hour. Critical!", "tech", False, URGENT),
    Labelled("After the update the app is so slow that it is useless. I want a refund for this month.", "tech",
             True, NORMAL),
    Labelled("Notifications stopped working on my phone.", "tech", False, NORMAL),
    Labelled("The import fails with an error message about the file format. Could someone check it this week?",
             "tech", False, NORMAL),
    Labelled("Two-factor codes never arrive and I am locked out of my account. Urgent please.", "tech", False,
             URGENT),
    Labelled("The printer integration is broken again. Give me my money back.", "tech", True, NORMAL),
    Labelled("Small bug: the date picker shows the wrong month. No rush at all.", "tech", False, LOW),
    Labelled("Every time I save a report the page freezes and I lose my work. Please fix this today.", "tech",
             False, URGENT),
    Labelled("I can't reset my password, the link in the email gives an error.", "tech", False, NORMAL),
    Labelled("Your app crashed and deleted my notes. I expect to be reimbursed.", "tech", True, NORMAL),
    Labelled("The API returns a 500 error for every request, production is down!", "tech", False, URGENT),
    # sales
    Labelled("How much would the Team plan cost for 15 people?", "sales", False, NORMAL),
    Labelled("We are thinking about upgrading to the Enterprise plan. Can someone send pricing? No rush.",
             "sales", False, LOW),
    Labelled("Do you have a discount for non-profits?", "sales", False, NORMAL),
    Labelled("Please send a quote for 200 seats, our budget meeting is tomorrow morning. Urgent.", "sales",
             False, URGENT),
    Labelled("I'd like to add five more seats to our plan.", "sales", False, NORMAL),
    Labelled("Is there a cheaper plan for students? Whenever you get a chance.", "sales", False, LOW),
    Labelled("What are the prices of the annual subscription compared with monthly?", "sales", False, NORMAL),
    Labelled("We need a price offer for 50 licences by the end of the day, asap please.", "sales", False, URGENT),
    Labelled("Can we try the Pro plan before we buy it?", "sales", False, NORMAL),
    Labelled("Our team is growing and we want to upgrade. Who can we talk to about volume pricing?", "sales",
             False, NORMAL),
    Labelled("Could you tell me the cost of the premium tier? It can wait until next month.", "sales", False, LOW),
    Labelled("Hi, do you offer volume discounts for more than 100 seats? Thanks!", "sales", False, NORMAL),
    Labelled("Our school wants to buy licences for all teachers. What is the price?", "sales", False, NORMAL),
    Labelled("We're ready to upgrade to 30 seats today, please send the quote immediately.", "sales", False,
             URGENT),
    Labelled("Is the mobile app included in the basic plan or do we pay extra?", "sales", False, NORMAL),
)

# The labels of the README's examples/requests.jsonl tickets, by request id.
README_LABELS: dict[str, dict[str, tasks.Label]] = {
    "ticket-1001": {"team": "billing", "refund": True, "urgency": NORMAL},
    "ticket-1002": {"team": "tech", "refund": False, "urgency": URGENT},
    "ticket-1003": {"team": "sales", "refund": False, "urgency": LOW},
}


def wording_examples() -> list[tasks.Example]:
    """``WORDINGS`` as labelled requests of the demo task (ids ``wording-<n>``)."""
    return [
        tasks.Example({"id": f"wording-{number}", "state": {"ticket": 9000 + number, "text": item.text},
                       "questions": tasks.TICKET_QUESTIONS},
                      {"team": item.team, "refund": item.refund, "urgency": item.urgency})
        for number, item in enumerate(WORDINGS, 1)
    ]


def readme_examples() -> list[tasks.Example]:
    """The tickets of ``examples/requests.jsonl``, as published, with ``README_LABELS``."""
    requests = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [tasks.Example({"id": r["id"], "state": r["state"], "questions": r["questions"]}, README_LABELS[r["id"]])
            for r in requests if r["id"] in README_LABELS]


def showcase_tickets() -> list[tasks.Example]:
    """The demo's hand-written tickets (``tasks.showcase`` without its pictures)."""
    return [example for example in tasks.showcase() if "images" not in example.request]
