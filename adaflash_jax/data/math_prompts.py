"""Multi-step arithmetic and word problems drawn from a seeded, version-stable RNG.

Each family fixes the numbers first and then the wording, so every problem has a clean
answer (no division into fractions of people, change is never negative). The supply is
unbounded; a problem is its own split group and exact repeats are removed by the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .records import PromptRecord, StableRandom

_PEOPLE = (
    ("Ana", "she"), ("Ben", "he"), ("Chloe", "she"), ("Dev", "he"), ("Elif", "she"), ("Farah", "she"),
    ("Goran", "he"), ("Hiro", "he"), ("Ines", "she"), ("Jamal", "he"), ("Kai", "they"), ("Lena", "she"),
    ("Mateo", "he"), ("Nadia", "she"), ("Omar", "he"), ("Priya", "she"), ("Quinn", "they"), ("Rosa", "she"),
    ("Sam", "they"), ("Tomas", "he"), ("Uma", "she"), ("Viktor", "he"), ("Wen", "she"), ("Yusuf", "he"),
)
_GOODS = (
    ("notebook", 2, 6), ("pen", 1, 3), ("apple", 1, 2), ("sandwich", 4, 9), ("ticket", 8, 25),
    ("T-shirt", 9, 30), ("book", 7, 24), ("coffee", 2, 5), ("plant", 5, 18), ("battery", 2, 7),
)
_BIG_GOODS = ("bicycle", "laptop", "guitar", "phone", "tent", "camera", "skateboard", "telescope")
_INSTRUCTIONS = (
    "", " Show your working.", " Explain each step.", " Think step by step.",
    " Give the final answer on its own line.", " Show the calculation, then state the answer.",
)


def _are(pronoun: str) -> str:
    return "have" if pronoun == "they" else "has"


def _shopping(rng: StableRandom) -> str:
    (name, _), goods = rng.choice(_PEOPLE), rng.sample(_GOODS, 2)
    counts = [rng.randint(2, 9) for _ in goods]
    prices = [rng.randint(low, high) for _, low, high in goods]
    total = sum(c * p for c, p in zip(counts, prices))
    bill = next((b for b in (20, 50, 100, 200, 500) if b > total), (total // 100 + 1) * 100)
    return (f"{name} buys {counts[0]} {goods[0][0]}s at ${prices[0]} each and {counts[1]} {goods[1][0]}s "
            f"at ${prices[1]} each, and pays with a ${bill} bill. How much change does {name} get?")


def _discount_and_tax(rng: StableRandom) -> str:
    item, price = rng.choice(_BIG_GOODS), rng.randint(8, 60) * 10
    discount, tax = rng.choice((10, 15, 20, 25, 30, 40)), rng.choice((5, 8, 10, 12))
    return (f"A {item} costs ${price}. It is on sale for {discount}% off, and a {tax}% sales tax is then "
            f"added to the sale price. What is the final price?")


def _average_speed(rng: StableRandom) -> str:
    speeds, hours = [rng.randint(4, 12) * 10 for _ in range(2)], [rng.randint(1, 4) for _ in range(2)]
    vehicle = rng.choice(("train", "bus", "car", "coach"))
    return (f"A {vehicle} travels {speeds[0] * hours[0]} km in {hours[0]} hours and then "
            f"{speeds[1] * hours[1]} km in {hours[1]} hours. What is its average speed over the whole trip?")


def _work_rates(rng: StableRandom) -> str:
    a, b = rng.sample((2, 3, 4, 5, 6, 8, 10, 12, 15), 2)
    workers = rng.choice((("One pipe", "another pipe", "fill a tank"), ("One printer", "a second printer",
                          "print a batch of flyers"), ("Ana", "Ben", "paint a fence")))
    return (f"{workers[0]} can {workers[2]} in {a} hours, and {workers[1]} can do it in {b} hours. "
            f"Working together, how long do they take?")


def _ages(rng: StableRandom) -> str:
    (older, _), (younger, _) = rng.sample(_PEOPLE, 2)
    young_age, factor, years = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 10)
    total_later = young_age * (factor + 1) + 2 * years
    return (f"{older} is {factor} times as old as {younger}. In {years} years the sum of their ages will "
            f"be {total_later}. How old is each of them now?")


def _population_change(rng: StableRandom) -> str:
    start, up, down = rng.randint(20, 90) * 100, rng.choice((5, 10, 12, 15, 20)), rng.choice((4, 5, 8, 10))
    place = rng.choice(("town", "village", "school", "club"))
    members = "residents" if place in ("town", "village") else "members"
    return (f"A {place} had {start} {members}. The number grew by {up}% in one year and fell by {down}% the "
            f"next year. How many {members} are there now, to the nearest whole number?")


def _unit_conversion(rng: StableRandom) -> str:
    kind = rng.randint(0, 3)
    if kind == 0:
        grams, loaves = rng.randint(3, 9) * 50, rng.randint(4, 24)
        return f"A loaf of bread needs {grams} g of flour. How many kilograms of flour do {loaves} loaves need?"
    if kind == 1:
        laps, metres = rng.randint(4, 30), rng.choice((200, 250, 400))
        return f"A runner completes {laps} laps of a {metres} m track. How many kilometres is that?"
    if kind == 2:
        hours, minutes = rng.randint(1, 9), rng.randint(1, 59)
        return f"How many seconds are there in {hours} hours and {minutes} minutes?"
    litres, distance = rng.randint(4, 12), rng.randint(3, 40) * 25
    return f"A car uses {litres} litres of fuel per 100 km. How much fuel does it need for {distance} km?"


def _expression(rng: StableRandom, depth: int) -> tuple[str, int]:
    """A random integer expression whose divisions are exact; returns (text, value)."""
    if depth == 0:
        value = rng.randint(2, 30)
        return str(value), value
    left_text, left = _operand(rng, depth - 1)
    operator = rng.choice("+-×÷")
    divisors = [d for d in range(2, 13) if left % d == 0]
    if operator == "÷" and not divisors:
        operator = "×"
    if operator == "÷":
        right = rng.choice(divisors)
        right_text = str(right)
    else:
        right_text, right = _operand(rng, rng.randint(0, depth - 1))
    operations = {"+": int.__add__, "-": int.__sub__, "×": int.__mul__, "÷": int.__floordiv__}
    return f"{left_text} {operator} {right_text}", operations[operator](left, right)


def _operand(rng: StableRandom, depth: int) -> tuple[str, int]:
    text, value = _expression(rng, depth)
    return (f"({text})" if depth > 0 else text), value


def _multi_step_expression(rng: StableRandom) -> str:
    text, _ = _expression(rng, rng.randint(2, 3))
    return rng.choice(("Evaluate {} step by step.", "Compute the value of {}.", "What is {}?")).format(text)


def _savings(rng: StableRandom) -> str:
    (name, pronoun), item = rng.choice(_PEOPLE), rng.choice(_BIG_GOODS)
    saved, weekly, price = rng.randint(2, 30) * 5, rng.randint(3, 12) * 5, rng.randint(20, 90) * 10
    return (f"{name} {_are(pronoun)} ${saved} saved and puts away ${weekly} every week. How many weeks "
            f"until {pronoun} can afford a {item} that costs ${price}?")


def _average_needed(rng: StableRandom) -> str:
    name, _ = rng.choice(_PEOPLE)
    scores = [rng.randint(55, 98) for _ in range(rng.randint(3, 5))]
    target = min(sum(scores) // len(scores) + rng.randint(2, 6), 95)
    return (f"{name}'s scores on {len(scores)} tests were {', '.join(map(str, scores))}. What score on the "
            f"next test would bring the average to {target}?")


def _fencing(rng: StableRandom) -> str:
    length, width, cost = rng.randint(5, 40), rng.randint(3, 25), rng.randint(4, 15)
    shape = rng.choice(("garden", "playground", "field", "car park"))
    return (f"A rectangular {shape} is {length} m long and {width} m wide. Fencing costs ${cost} per metre. "
            f"What is the area of the {shape}, and how much does it cost to fence all the way around it?")


def _interest(rng: StableRandom) -> str:
    principal, rate, years = rng.randint(5, 100) * 100, rng.randint(2, 9), rng.randint(2, 6)
    if rng.randint(0, 1):
        return (f"${principal} is invested at {rate}% simple interest per year. How much interest is earned "
                f"in {years} years?")
    return (f"${principal} is deposited at {rate}% interest compounded yearly. What is the balance after "
            f"{years} years, to the nearest cent?")


def _sharing(rng: StableRandom) -> str:
    people, each, left = rng.randint(3, 12), rng.randint(4, 20), rng.randint(0, 2)
    left = min(left, people - 1)
    things = rng.choice(("sweets", "marbles", "stickers", "cards", "coins"))
    return (f"{people} friends share {people * each + left} {things} as equally as possible. How many does "
            f"each friend get, and how many are left over?")


def _recipe_scaling(rng: StableRandom) -> str:
    serves, wanted = rng.choice((2, 4, 6)), rng.choice((3, 5, 8, 9, 10, 12))
    numerator, denominator = rng.choice(((1, 2), (2, 3), (3, 4), (1, 3), (3, 2)))
    ingredient = rng.choice(("sugar", "flour", "milk", "rice", "oats"))
    return (f"A recipe for {serves} people uses {numerator}/{denominator} cup of {ingredient}. "
            f"How much {ingredient} is needed for {wanted} people?")


MATH_FAMILIES: dict[str, Callable[[StableRandom], str]] = {
    "shopping": _shopping, "discount_and_tax": _discount_and_tax, "average_speed": _average_speed,
    "work_rates": _work_rates, "ages": _ages, "population_change": _population_change,
    "unit_conversion": _unit_conversion, "multi_step_expression": _multi_step_expression,
    "savings": _savings, "average_needed": _average_needed, "fencing": _fencing, "interest": _interest,
    "sharing": _sharing, "recipe_scaling": _recipe_scaling,
}


def math_records(seed: int) -> Iterator[tuple[str, PromptRecord]]:
    """An endless stream of `(problem, record)`; the caller decides how many to take."""
    rng = StableRandom(seed)
    families = sorted(MATH_FAMILIES)
    while True:
        family = rng.choice(families)
        prompt = MATH_FAMILIES[family](rng) + rng.choice(_INSTRUCTIONS)
        yield prompt, PromptRecord(prompt, "math", f"math:{family}")
