"""A synthetic, seeded, labelled decision task: support tickets and pictures, generated in code.

The demo checkpoint is trained on it (``dev/train.py``) and judged on a held-out draw of it, so that
the embedded default answers something a reader can check, and ``d3stream compare --labels`` can say
which of two checkpoints is right, all offline. Every draw is a pure function of its seed.

Two kinds of requests:

* a **ticket** (``state``: ``{"ticket": n, "text": ...}``) with three questions: ``team`` (``choice``:
  billing, tech or sales), ``refund`` (``noul``: does the customer want a payment reversed, i.e. ask for
  their money back) and ``urgency`` (``score``: low, medium, high). The text is put together from a
  grammar of sentences with wide wording (below), and the three answers are drawn independently (a tech
  ticket may ask for a refund too), so a model cannot get one right from another.

  The questions are worded apart from the words tickets decide with: the demo checkpoint reads every
  question at the same last position, and a word that is in both ("urgent" in a ticket and in "How urgent
  is the ticket? ... C. urgent") it could not weigh (measured, issue 43: "This is urgent!" scored normal,
  "crashes" sent tickets to billing while the team options listed "crashes"). Hence "How soon does the
  ticket need an answer?" with levels low, medium, high, options without descriptions, and "a payment
  reversed" rather than "money back".
* a **picture** (an inline PNG of one to three coloured squares on a plain background) with one question,
  ``red_square`` (``noul``: is there a red square).

Labels are ``{"id", "question", "answer"}`` records, the format ``d3stream compare --labels`` reads:
the choice key, true / false, or the score level index.
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

if TYPE_CHECKING:
    from d3stream.runtime import D3

# Seeds of the standard draws: training and the held-out set never share a seed.
TRAIN_SEED = 0
HELDOUT_SEED = 1

TEAM: dict[str, object] = {
    "type": "choice",
    "instructions": "Which team should handle this ticket?",
    "criteria": {"billing": None, "tech": None, "sales": None},
}
REFUND: dict[str, object] = {"type": "noul", "instructions": "Does the customer want a payment reversed?"}
URGENCY: dict[str, object] = {"type": "score", "instructions": "How soon does the ticket need an answer?",
                              "criteria": ["low", "medium", "high"]}
TICKET_QUESTIONS: dict[str, dict[str, object]] = {"team": TEAM, "refund": REFUND, "urgency": URGENCY}
RED_SQUARE: dict[str, object] = {"type": "noul", "instructions": "Is there a red square in the picture?"}
PICTURE_QUESTIONS: dict[str, dict[str, object]] = {"red_square": RED_SQUARE}

# The ticket grammar. A sentence is a template whose ``[a|b|c]`` groups are alternatives (one drawn per use, ``[|x]``:
# x or nothing) and whose ``{slot}`` fields are filled from ``_SLOTS``. The wording is deliberately wide: what
# a customer writes to billing, tech or sales, asking for money back or not, in a hurry or not, politely or
# curtly, with greetings, asides and money mentioned for other reasons, so that a model fitted on it learns
# which words decide, not which templates occur (issue 43: a checkpoint fitted on a few sentences per team
# answered its own templates right and a newcomer's wording wrong). Every team, refund and urgency sentence
# can meet every other, so no answer follows from another.
_SLOTS: dict[str, tuple[str, ...]] = {
    "product": ("Pro plan", "Team plan", "Starter plan", "Business plan", "Enterprise plan", "basic plan",
                "mobile app", "desktop app", "web app", "Android app", "iPhone app", "browser extension",
                "Premium plan", "family plan", "premium account", "starter kit"),
    "amount": ("$12", "$49", "$99", "19 EUR", "$240", "$7.50", "€30", "£15", "120 dollars", "$1,200", "45 euros",
               "$5", "300 EUR", "$64.99"),
    "n": ("5", "8", "ten", "12", "twenty", "25", "40", "60", "100", "250", "three", "fifteen"),
    "when": ("yesterday", "last week", "this morning", "on Monday", "last month", "in March", "two days ago"),
    "since": ("yesterday", "last week", "this morning", "Monday", "the weekend", "the last update", "the new version"),
    "feature": ("export", "search", "login page", "upload", "sync", "settings page", "report builder",
                "calendar", "import", "share button", "checkout page", "file preview", "editor", "dashboard"),
    "doing": ("open it", "log in", "save a file", "upload a photo", "click export", "tap the button", "start it",
              "change my settings", "open a report", "share a document", "switch accounts", "print"),
    "document": ("invoice", "receipt", "bill", "statement", "billing statement", "credit note"),
    "fault": ("crashes", "freezes", "hangs", "closes by itself", "stops responding", "shows a blank screen",
              "keeps crashing", "throws an error", "gives me an error", "is broken", "does not work",
              "fails", "keeps failing", "is very slow", "won't load", "doesn't load", "logs me out"),
    "error": ("an error", "error 500", "error 404", "error 403", "a server error", "an error message",
              "a timeout", "an unknown error", "a bug", "a white page", "a crash report"),
    "payment": ("payment", "charge", "fee", "debit", "transaction", "renewal fee", "subscription fee"),
}

_TEAMS: dict[str, tuple[str, ...]] = {
    "billing": (
        "[My card was|My credit card was|Our company card was|I was|We were|I got] [charged|billed] [twice|two "
        "times|double] for the {product}.",
        "There is [an extra|a strange|an unknown|a duplicate|a second] {payment} of {amount} on my "
        "[statement|card|bank account|credit card].",
        "[My|Our|The last] {document} [is wrong|shows the wrong amount|has the wrong address|is missing the VAT "
        "number|lists the wrong plan|has the wrong company name].",
        "[Please|Could you|Can you] [send|email|resend] me [the|a corrected|a copy of the|my] {document} for the "
        "{product}[| from last month| from March]?",
        "The {payment} for my {product} [failed|was declined|did not go through] but the money left my account.",
        "My [payment|card] [keeps getting|was|is] declined[| at checkout| for the renewal].",
        "Why [is there|did you take|was I charged] {amount} [on my card|this month|for the renewal|{when}]?",
        "I [cancelled|stopped|ended] my {product} [{when}|last month|in time] but you [still charged|charged|"
        "billed] me {amount}.",
        "[How do I|How can I|Please help me] [change|update] the [card|payment method|billing address|billing "
        "email|VAT number] on [my|our] account.",
        "The {payment} was [taken|debited|collected] [twice|again|too early|two times] from [my|our] "
        "[account|card].",
        "[My bank|My statement|Our accountant] [shows|found] [two|duplicate|double] payments for the {product}.",
        "[I was|We were] [overcharged|billed too much|billed the wrong amount] for the {product}.",
        "You [overcharged me|billed me too much|billed us the wrong amount] for the {product}.",
        "The {document} [amount|total] does not match what I paid.",
        "[We were|I was] billed in dollars but [our contract|my plan] is in euros.",
        "[Where can I|How do I] [download|find|get] [my|our|the] {document}s?",
        "I need [a|an official|a proper] {document} for [my expenses|our accounting|the tax office].",
        "Your {payment} [hit|appeared on] my [card|account] {when} [and I do not know why|without warning].",
        "[Double charge|Duplicate charge|Wrong invoice|Billing problem|Charged twice] on [my|our] account.",
        "[Card|Account] charged twice for the {product}.",
        "The automatic renewal [charged|billed] me even though [auto-renew is off|I cancelled].",
        "[I|We] [paid|was charged|got charged] {amount} [instead of|but the price was] {amount}.",
        "My {payment} [is|shows as] pending [for a week|since {since}] and the {product} is not active.",
        "[You|Your system] [took|charged] [my|the] money [twice|two times] [this month|{when}].",
        "[There are|I see|We have] [two|duplicate|strange|unexpected] charges [on my card|on our account|this month].",
        "[My|Our] [invoices|payments] [are wrong|do not match|are missing|failed][| since {since}].",
        "[Please|Could you] [check|explain] the charges on my [card|statement|invoice].",
    ),
    "tech": (
        "The {product} {fault} [every time|whenever|as soon as|when] I {doing}.",
        "The {feature} in the {product} {fault}[| {when}].",
        "I [cannot|can't|am unable to|could not] [log in|sign in|reset my password|upload files|export my data|"
        "open my files|connect my account|save my work] since {since}.",
        "[I get|I see|There is|It shows|I keep getting] {error} when I {doing}.",
        "[Sync|Search|Login|The export|The upload|The {feature}|Notifications|Two-factor login] [is broken|doesn't "
        "work|stopped working|fails|is very slow|keeps failing] [in the {product}|{when}|again].",
        "The [website|page|app|API|server|{product}] [does not load|times out|is down|returns {error}|is offline].",
        "[The password reset email|The verification code|The invite link|The login link|The confirmation email] "
        "[never arrives|doesn't work|has expired|gives {error}|goes nowhere].",
        "After the [update|latest release|new version] the {product} {fault}.",
        "[There is|I found] a bug in the {feature}: it [shows the wrong data|loses my changes|ignores my "
        "settings|returns no results|duplicates every entry].",
        "My [files|photos|notes|reports|contacts] [disappeared|were deleted|are gone|will not open] after "
        "[syncing|the update|{when}].",
        "[The {product}|It|The {feature}] {fault}.",
        "[Error|Bug|Crash|Login broken|Sync broken|App broken] [in|on] the {product}.",
        "[App|Site|{product}|Login] [down|broken|crashing|not loading].",
        "The {product} [is stuck on|never gets past] the [loading screen|login screen|splash screen].",
        "[I am|We are|My colleague is] locked out of [my|our|the] account[| since {since}].",
        "[The page|The {feature}|The {product}] [freezes|hangs|goes blank] and I lose my work.",
        "[Pictures|Documents|Exports|Uploads] [come out broken|are empty|fail halfway] in the {product}.",
        "The {product} [uses all my battery|runs very slowly|keeps logging me out|will not install].",
        "[How do I fix|What does it mean when I get|Why do I get] {error} in the {product}?",
        "[Clicking|Tapping] the {feature} [does nothing|shows {error}|closes the {product}].",
        "The {product} crashes[| on startup| all the time| every day| when I {doing}].",
        "[Constant|So many|Lots of|Random] [crashes|errors|bugs] [in|with] the {product}[| since {since}].",
        "[Login|The login page|The login button|Login with Google] [is broken|fails|does not work|gives {error}].",
        "I [see|get|keep seeing] [errors|bugs|crashes] [when I {doing}|in the {feature}].",
    ),
    "sales": (
        "[How much|What] does the {product} cost for [a team of {n}|{n} users|{n} seats|{n} people]?",
        "[Can I|Could I|Can we|Could we] [get|have] a [quote|price quote|quotation|proposal|price offer] for "
        "[{n} seats|{n} licences|the {product}|the {product} for {n} users]?",
        "[Please|Could you|Can you] send [me|us] [a quote|pricing|your price list|an offer|a proposal] for "
        "[{n} seats|the {product}|{n} licences|our team].",
        "Do you [offer|have|give] [a discount|discounts|special pricing|a cheaper plan|volume pricing|an education "
        "price] for [schools|non-profits|startups|students|annual billing|more than {n} seats]?",
        "[We want|We would like|I want|I'd like|We plan] to [upgrade to|buy|add more seats to|switch to|purchase] "
        "the {product}.",
        "[We want|We would like|We need] to [add|buy] {n} more [seats|licences|users][| on the {product}].",
        "What are the [prices|pricing|plans|tiers|price options] [of|for] the {product}?",
        "[Can we|Could we|Is it possible to] [try|test|get a trial of|get a demo of] the {product} before we "
        "buy[| it]?",
        "[I'd like to|We want to|Can I] talk to [sales|someone about pricing|an account manager|your sales "
        "team][| about the {product}].",
        "Is the {product} included in the [basic plan|Pro plan|Team plan] or [does it cost extra|do we pay "
        "extra]?",
        "[Our team|Our company|Our school] is growing[,| and] [we need more seats|we want to upgrade|we are "
        "looking at the {product}].",
        "[What is|What's] the [price|cost|monthly price|yearly price] of the {product}?",
        "[Quote|Pricing|Prices|Price list] for {n} seats[| please]?",
        "[Upgrade|Purchase|More seats] for [our team|the {product}|{n} users].",
        "[We are|I am] comparing [plans|offers|vendors] and [need|want] [your prices|a quote|pricing] for {n} "
        "seats.",
        "[Do you sell|Can we buy|Is there] a [yearly|annual|multi-year|volume] [licence|plan|contract] for the "
        "{product}?",
        "[How much|What] would it cost to [upgrade|move] from the basic plan to the {product}?",
        "[Our budget is|We can spend] {amount} per [month|year]: which plan [fits|should we buy]?",
        "What [plans|pricing options|price plans] do you [offer|have] for [teams|{n} users|schools]?",
        "[Please|Can you] send [us|me] [pricing|quotes|your plans] for {n} [seats|users].",
        "[I'm|We're] interested in your [plans|pricing][| for the {product}].",
    ),
}
# Asking for money back (refund: true), in many words.
_REFUND = (
    "[I want|I would like|I'd like|I need|I expect|I demand|Can I get|Could I get] [a refund|my money back|a full "
    "refund|a partial refund|the money back|a refund of {amount}].",
    "[Please|Kindly|Could you|Can you] [refund|reimburse|return|reverse|credit back] [the charge|the payment|the "
    "{amount}|the second payment|the difference|my money|it|the fee].",
    "[Please give me|Give me|Send me|Return] my money back[| please|, thanks].",
    "[Refund|Reimburse me|Money back|Chargeback|Reverse the charge][| please|, please|, now]!",
    "[I will|I'll] [ask my bank for a chargeback|file a chargeback|dispute the charge] unless you refund me.",
    "[Charge it back|Issue a refund|Refund me|Reverse the payment|Send the money back|Pay me back][| please|, "
    "please|, thanks].",
    "[I want|I'd like|Please arrange for] the {amount} [returned|refunded|reimbursed|credited back] to my "
    "[card|account].",
    "I expect to be [reimbursed|refunded|paid back|compensated with a refund][| for this| for the month].",
    "[We want|We'd like|We expect] [a refund|our money back|to be reimbursed][| for the {product}| for the unused "
    "months].",
    "[Cancel it and refund me|Cancel and refund|Cancel my {product} and give me my money back].",
)
# A billing ticket that is a request for money back and nothing else (refund: true).
_BILLING_REFUNDS = (
    "[The unused months of my subscription|My {product} subscription|The renewal fee|The annual fee|The last "
    "invoice|The {amount} subscription fee] should be refunded.",
    "[Please|Kindly] refund [my subscription|the renewal fee|the {amount} subscription fee|my last invoice].",
    "[My subscription|The renewal|Our annual fee|The last invoice]: [refund|money back|reimbursement] [please|"
    "wanted].",
)
# Asides a ticket may hold whatever it asks: thanks, details, and money mentioned for other reasons.
_ASIDES = (
    "[I have attached|Attached is|Here is] a screenshot.",
    "[Thanks for your help|Thank you|Thanks in advance|Many thanks].",
    "Let me know what you need from me.",
    "[I paid|We paid] {amount} for [it|the {product}][| {when}].",
    "The {amount} {payment} [itself|on my card] is [correct|fine|right].",
    "[My account email is|You can reach me at] anna@example.com.",
    "[I have been|We have been] [a customer|customers|users] for [years|three years|a long time].",
    "[My colleague|My manager|Our admin] [asked me to write|told me to contact you].",
    "[Our|My] account number is {n}[|001|-552].",
    "[We spend {amount} a [month|year] on|We pay {amount} a [month|year] for] the {product}.",
    "This is my [second|third] [message|ticket|email] about it.",
    "This is [for|about] our [company|team|office|school] account.",
)
# Said instead of asking for money back (refund: false): nothing, an aside, or money back declined.
_NO_REFUND = (
    "", "", "", "", "", *_ASIDES,
    "I [do not|don't] [want|need] [a refund|my money back|to be reimbursed], [just|only] [a fix|an answer|the "
    "{document}|help].",
    "[No refund needed|Money is not the issue|I am happy to pay for it].",
)
_URGENCY = (
    (  # 0 low
        "No rush[| on this| at all].", "No hurry[| at all].", "[Whenever you [can|get a chance|have time]].",
        "[It|This] can wait [until next week|until next month|a few days|a while].", "Low priority[|, just so you "
        "know].", "[Not urgent|This is not urgent|Nothing urgent][|, just letting you know].",
        "Take your time[| with this].", "[Just letting you know|Just so you know|Just an FYI].",
        "There is no deadline.", "[Any time|Sometime] [next week|next month|this quarter] is fine.",
        "[Low urgency|Not a priority|Not pressing].",
    ),
    (  # 1 normal: nothing said, or a few days
        "", "", "", "", "",
        "Could you look at it this week?", "Let me know how to proceed.", "[Please get back to me|Please reply] "
        "[when you can|this week|in the next days].", "[Thanks|Thank you|Regards].",
        "[A reply this week|An answer in the next few days] would be [good|great].",
    ),
    (  # 2 urgent ("urgent" itself the most common word, as in real tickets: three times as likely)
        *["[This is|It is|It's|This is very|This is really|That is|Very|Really] urgent[!|.|!!]"] * 2,
        "[Urgent|Very urgent|Extremely urgent|Quite urgent][, please|!| request.]", "[This is|It is|It's] [critical|an "
        "emergency]!", "[Urgent|URGENT|Critical|ASAP][.|!|: please help.]", "[Please treat this as|Marking this "
        "as|This is an] urgent [request|matter|issue].", "[Urgent|This is urgent], [please|thanks].",
        "ASAP [please|, please]!", "[Please|We need this|I need this] [fixed|solved|answered|sorted] "
        "[today|right now|immediately|within the hour|asap].", "[Our|My] [whole team|business|office|shop|"
        "production|work] is [blocked|stuck|down|at a standstill].", "We are losing money every [hour|minute].",
        "[Please help|Help] [urgently|immediately|now|asap]!", "[We|I] cannot wait: [today|now|this morning] "
        "[please|at the latest].", "This is blocking [our launch|the whole team|our customers|everything].",
        "[Right now|Immediately|Today], please.",
    ),
)
_GREETINGS = ("", "", "", "Hello,", "Hi,", "Hi team,", "Good morning,", "Dear support,", "Hey,", "Hi there,")
_CLOSINGS = ("", "", "", "", "Thanks.", "Thank you!", "Best regards, Anna", "Cheers, Tom", "Kind regards.")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "black": (20, 20, 20),
}
_BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (200, 215, 230), (245, 235, 215))
PICTURE_SIZE = 96


class Ticket(TypedDict):
    """A ticket's state."""

    ticket: int
    text: str


class TaskRequest(TypedDict):
    """A request of the task: a ticket (its state a ``Ticket``) or a picture (a sentence, and one image)."""

    id: str
    state: Ticket | str
    questions: dict[str, dict[str, object]]
    images: NotRequired[list[str]]  # a data: URL


# A label: the choice key (choice), true or false (noul), or the score level index (score).
Label = str | bool | int


@dataclass(frozen=True)
class Example:
    """One labelled request: the request (``id``, ``state``, ``questions``, maybe ``images``) and its labels
    by question id."""

    request: TaskRequest
    labels: dict[str, Label]

    @property
    def id(self) -> str:
        return self.request["id"]


def _expand(rng: random.Random, template: str) -> str:
    """A template with its ``[a|b]`` groups chosen (innermost first) and its ``{slot}`` fields filled."""
    while True:
        group = _GROUP.search(template)
        if group is None:
            break
        template = template[: group.start()] + rng.choice(group.group(1).split("|")) + template[group.end() :]
    return _SLOT.sub(lambda field: rng.choice(_SLOTS[field.group(1)]), template)


_GROUP = re.compile(r"\[([^\[\]]*)\]")
_SLOT = re.compile(r"\{(\w+)\}")


def ticket_text(rng: random.Random, team: str, refund: bool, urgency: int) -> str:
    """A ticket's text: one or two sentences of the team's, one asking for money back or not, one saying how
    urgent it is (or nothing), in a drawn order, maybe with a greeting, a closing and an aside. (A billing
    ticket asking for money back may be that request alone, for a subscription or a fee.)"""
    topic = [_expand(rng, rng.choice(_TEAMS[team])) for _ in range(1 if rng.random() < 0.7 else 2)]
    asking = [_expand(rng, rng.choice(_REFUND if refund else _NO_REFUND))]
    if team == "billing" and refund and rng.random() < 0.15:
        # Money back for a subscription or a fee, and nothing else: billing's, as a support desk routes it.
        topic, asking = [_expand(rng, rng.choice(_BILLING_REFUNDS))], []
    middle = [*topic, *asking]
    if rng.random() < 0.2:
        middle.append(_expand(rng, rng.choice(_ASIDES)))
    rng.shuffle(middle)
    middle.insert(rng.randrange(len(middle) + 1), _expand(rng, rng.choice(_URGENCY[urgency])))
    parts = [rng.choice(_GREETINGS), *middle, rng.choice(_CLOSINGS)]
    text = " ".join(" ".join(part.split()) for part in parts if part.strip())
    text = text.replace(" ,", ",").replace(" .", ".").replace(" !", "!").replace(" ?", "?")
    if rng.random() < 0.1:
        text = text.lower()  # typed in a hurry
    return text


def ticket(rng: random.Random, number: int, prefix: str) -> Example:
    """A support ticket with independently drawn team, refund and urgency."""
    team = rng.choice(list(_TEAMS))
    refund = rng.random() < 0.4
    urgency = rng.randrange(3)
    text = ticket_text(rng, team, refund, urgency)
    request: TaskRequest = {"id": f"{prefix}-ticket-{number}", "state": {"ticket": 1000 + number, "text": text},
                            "questions": TICKET_QUESTIONS}
    return Example(request, {"team": team, "refund": refund, "urgency": urgency})


def picture_png(rng: random.Random, red: bool) -> bytes:
    """A PNG of one to three non-red squares on a plain background, one of them red when ``red``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (PICTURE_SIZE, PICTURE_SIZE), rng.choice(_BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    others = [name for name in COLOURS if name != "red"]
    colours = [rng.choice(others) for _ in range(rng.randint(1, 3) - (1 if red else 0))]
    if red:
        colours.insert(rng.randrange(len(colours) + 1), "red")
    for colour in colours:
        side = rng.randint(24, 40)
        x, y = rng.randint(0, PICTURE_SIZE - side), rng.randint(0, PICTURE_SIZE - side)
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def picture(rng: random.Random, number: int, prefix: str) -> Example:
    """An image request asking whether there is a red square (half of them have one)."""
    red = rng.random() < 0.5
    url = "data:image/png;base64," + base64.b64encode(picture_png(rng, red)).decode()
    request: TaskRequest = {"id": f"{prefix}-picture-{number}", "state": "A picture attached to a support ticket.",
                            "questions": PICTURE_QUESTIONS, "images": [url]}
    return Example(request, {"red_square": red})


def draw(seed: int, tickets: int, pictures: int = 0, prefix: str | None = None) -> list[Example]:
    """``tickets`` tickets and ``pictures`` pictures from ``seed``, interleaved; ids start with ``prefix``
    (default ``s<seed>``)."""
    rng = random.Random(seed)
    prefix = prefix or f"s{seed}"
    examples = [ticket(rng, number, prefix) for number in range(tickets)]
    examples += [picture(rng, number, prefix) for number in range(pictures)]
    rng.shuffle(examples)
    return examples


def heldout(tickets: int = 60, pictures: int = 20) -> list[Example]:
    """The standard held-out set: ``HELDOUT_SEED``, never trained on."""
    return draw(HELDOUT_SEED, tickets, pictures, prefix="heldout")


def showcase() -> list[Example]:
    """Hand-written tickets and two pictures whose answers a reader can judge at a glance (the demo's)."""
    texts: list[tuple[str, dict[str, Label]]] = [
        ("My card was charged twice for the Pro plan. Please give me my money back. This is urgent!",
         {"team": "billing", "refund": True, "urgency": 2}),
        ("The desktop app crashes every time I open it. No rush on this.",
         {"team": "tech", "refund": False, "urgency": 0}),
        ("Can I get a quote for the Team plan? Could you look at it this week?",
         {"team": "sales", "refund": False, "urgency": 1}),
        ("I cannot log in since the last update of the mobile app. I want a refund. We need this solved today.",
         {"team": "tech", "refund": True, "urgency": 2}),
    ]
    examples = [
        Example({"id": f"ticket-{number}", "state": {"ticket": 4311 + number, "text": text},
                 "questions": TICKET_QUESTIONS}, labels)
        for number, (text, labels) in enumerate(texts, 1)
    ]
    rng = random.Random(4312)
    for name, red in (("red", True), ("no-red", False)):
        url = "data:image/png;base64," + base64.b64encode(picture_png(rng, red)).decode()
        examples.append(Example({"id": f"picture-{name}", "state": "A picture attached to a support ticket.",
                                 "questions": PICTURE_QUESTIONS, "images": [url]}, {"red_square": red}))
    return examples


class LabelRecord(TypedDict):
    """One question's label, as ``d3stream compare --labels`` reads it."""

    id: str
    question: str
    answer: Label


def label_records(examples: Iterable[Example]) -> list[LabelRecord]:
    """``{"id", "question", "answer"}`` records for ``d3stream compare --labels``."""
    return [{"id": e.id, "question": key, "answer": value} for e in examples for key, value in e.labels.items()]


def write_task(out: str | Path, examples: list[Example]) -> tuple[Path, Path]:
    """``requests.jsonl`` (for ``d3stream produce``) and ``labels.jsonl`` (for ``compare --labels``) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    requests, labels = out / "requests.jsonl", out / "labels.jsonl"
    requests.write_text("".join(json.dumps(e.request) + "\n" for e in examples), encoding="utf-8")
    labels.write_text("".join(json.dumps(r) + "\n" for r in label_records(examples)), encoding="utf-8")
    return requests, labels


def answer_records(model: D3, examples: Iterable[Example]) -> dict[str, dict[str, object]]:
    """Answer records by request id, from a loaded ``D3`` run in process (no Kafka): the input of
    ``d3stream.jobs.compare.compare`` with ``label_records`` as its labels."""
    answers: dict[str, dict[str, object]] = {}
    for example in examples:
        request = example.request
        response = model.system_one(state=request["state"], questions=request["questions"],
                                    images=request.get("images"))
        answers[example.id] = {"id": example.id, **response}
    return answers
