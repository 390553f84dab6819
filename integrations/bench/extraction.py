"""The structured workload's schema and prompts: records extracted from short messages.

``Extraction`` is a nested schema (objects, an array of objects, enums, bounded integers,
every field required); its string lengths and array sizes are bounded so that a reply stays
under ``MAX_OUTPUT_TOKENS``. ``extraction_prompts(n)`` builds ``n`` varied messages (orders,
event registrations, bookings; notes, emails, chat lines) deterministically from templates.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_OUTPUT_TOKENS = 160  # every string at its longest, one token a character: 144 tokens with EOS

SYSTEM = (
    "Extract the record from the user's message as JSON: kind (order, event or booking), "
    "person (name, age, role), items (name and quantity of each), city and priority."
)


class Person(BaseModel):
    """Who the message is from."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=20)
    age: int = Field(ge=0, le=120)
    role: Literal["customer", "attendee", "guest", "staff"]


class Item(BaseModel):
    """One thing asked for, with how many."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=20)
    quantity: int = Field(ge=1, le=99)


class Extraction(BaseModel):
    """The record of one message."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["order", "event", "booking"]
    person: Person
    items: list[Item] = Field(min_length=1, max_length=2)
    city: str = Field(min_length=1, max_length=16)
    priority: Literal["low", "normal", "high"]


def is_valid(text: str) -> bool:
    """Whether ``text`` is JSON that ``Extraction`` accepts (strictly: no coercion)."""
    try:
        Extraction.model_validate_json(text, strict=True)
    except ValidationError:
        return False
    return True


_FIRST = ("Maria", "Tomasz", "Aiko", "Kwame", "Lena", "Rahul", "Sofia", "Jonas", "Amara", "Diego", "Ines", "Oleg")
_LAST = ("Lopez", "Nowak", "Tanaka", "Mensah", "Fischer", "Iyer", "Rossi", "Berg", "Okafor", "Silva", "Costa", "Petrov")
_CITIES = ("Lisbon", "Krakow", "Osaka", "Accra", "Hamburg", "Pune", "Turin", "Oslo", "Lagos", "Recife", "Porto",
           "Kazan")  # fmt: skip
_PRODUCTS = ("desk lamp", "office chair", "USB cable", "notebook", "coffee grinder", "yoga mat", "water bottle",
             "phone case", "backpack", "kettle")  # fmt: skip
_EVENTS = ("jazz night", "tech meetup", "cooking class", "book fair", "film festival", "chess open")
_TICKETS = ("standard ticket", "VIP pass", "student ticket", "workshop seat")
_ROOMS = ("double room", "single room", "parking spot", "breakfast", "suite")
_URGENCY = {
    "low": ("no rush at all", "whenever it suits you", "it can wait a few weeks"),
    "normal": ("the usual timing is fine", "within the normal schedule", "standard handling please"),
    "high": ("this is urgent", "I need it as soon as possible", "please treat it as top priority"),
}

_ORDER = (
    "Order note: {name} ({age}, a regular customer) from {city} wants {items}. {urgency}.",
    "Hi, I'm {name}, {age} years old, writing from {city}. Please send me {items}; {urgency}.",
    "Subject: new order\n\nDear shop, my name is {name} and I live in {city}. I am {age}. "
    "I would like {items}. {urgency}. Thanks!",
    "chat> {name} here ({age}y, {city}) - can I get {items}? {urgency}",
)
_EVENT = (
    "Registration for the {event} in {city}: {name}, age {age}, attending with {items}. {urgency}.",
    "Hello! {name} ({age}) would like to join the {event} in {city}. I need {items}. {urgency}.",
    "Sign-up form - event: {event}; city: {city}; attendee: {name}; age: {age}; tickets: {items}; note: {urgency}.",
)
_BOOKING = (
    "Booking request from {name}, {age}, a returning guest: {items} at your hotel in {city}. {urgency}.",
    "Good evening, this is {name} (age {age}). For my stay in {city} please reserve {items}. {urgency}.",
    "Front desk memo: staff member {name}, {age}, books {items} in the {city} branch. {urgency}.",
)
_KINDS = (("order", _ORDER, _PRODUCTS), ("event", _EVENT, _TICKETS), ("booking", _BOOKING, _ROOMS))


def extraction_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct user messages, the same for the same arguments.

    Kinds and their phrasings are cycled, so any ``num_prompts`` of 12 or more covers every
    template; people, ages, cities, items (one or two, with quantities) and urgency are drawn
    from ``seed``.
    """
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        kind, templates, things = _KINDS[i % len(_KINDS)]
        template = templates[(i // len(_KINDS)) % len(templates)]
        chosen = rng.sample(things, rng.randint(1, 2))
        items = ", ".join(f"{rng.randint(1, 12)} x {thing}" for thing in chosen)
        prompts.append(
            template.format(
                name=f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
                age=rng.randint(18, 85),
                city=rng.choice(_CITIES),
                event=rng.choice(_EVENTS),
                items=items,
                urgency=rng.choice(_URGENCY[rng.choice(tuple(_URGENCY))]).capitalize(),
            )
        )
    return prompts
