"""Seeded grade-school word problems in exact GSM8K format, for offline runs and curricula.

Why generate: the pipeline must run end to end without hub access, and curriculum stages need
problems of *known* difficulty (GSM8K's annotation count is only a proxy). A problem chains
``ops`` operations (+, -, *, /, and two-operation events such as "k items at $b each" or "p% off")
over one running quantity: ``ops = 1`` is one operation. Each is annotated GSM8K-style
(``<<a*b=c>>``), the solution ends with ``#### N``, and every value is a positive integer.

Determinism: problem ``i`` is drawn from its own :class:`random.Random` seeded with a string derived
from ``(seed, i)``. String seeds go through SHA-512, unlike ``hash()``, so the same seed gives the
same problems in every process, and the first N problems do not depend on how many are generated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.core.errors import DataError
from posttrain.core.gsm8k import RECORD_FIELDS

logger = logging.getLogger(__name__)

__all__ = ["NUMBER_SIZES", "THEMES", "THEME_NAMES", "generate_problems"]

# A hand-laid-out table reads better than the formatter's one-item-per-line expansion.
# fmt: off
# Name and pronoun set (He, he, him, His, his).
_PEOPLE = [
    ("Maya", "f"), ("Liam", "m"), ("Sofia", "f"), ("Noah", "m"), ("Aisha", "f"), ("Mateo", "m"),
    ("Chen", "m"), ("Priya", "f"), ("Omar", "m"), ("Elena", "f"), ("Kofi", "m"), ("Hana", "f"),
    ("Lucas", "m"), ("Zoe", "f"), ("Ravi", "m"), ("Nora", "f"), ("Diego", "m"), ("Yuki", "f"),
    ("Samuel", "m"), ("Amara", "f"), ("Felix", "m"), ("Ines", "f"), ("Tariq", "m"), ("Lena", "f"),
]
_PRONOUNS = {
    "m": {"He": "He", "he": "he", "him": "him", "His": "His", "his": "his"},
    "f": {"He": "She", "he": "she", "him": "her", "His": "Her", "his": "her"},
}
_PERCENTS = (10, 20, 25, 30, 40, 50, 60, 75, 80)

_COST = {"add": 1, "sub": 1, "mul": 1, "div": 1, "buy": 2, "earn": 2, "pct_off": 2, "pct_on": 2}  # operations each

Draw = tuple[dict[str, int], list[tuple[str, int]], int]  # template params, (expression, result)s, new value


@dataclass(frozen=True)
class Theme:
    """One story: how the running quantity starts, how each operation is phrased, what is asked.

    Templates are ``str.format`` strings. Questions see ``{name}``, pronouns (``{He}`` ...),
    ``{a}``/``{b}``/``{k}`` operands and, for comparison chains, ``{prev}``/``{cur}``; solutions also
    see ``{calc}`` (or ``{calc1}``/``{calc2}`` for two-step operations), rendered ``2*3 = <<2*3=6>>6``.
    ``finals`` are single operations phrased as the closing question (e.g. "shared among b friends,
    how many each?"), used sometimes as the last step.
    """

    name: str
    question: str
    start: tuple[int, int]
    cap: int
    intros: tuple[str, ...] = ()
    products: tuple[tuple[str, str, tuple[int, int], tuple[int, int]], ...] = ()
    ops: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    finals: tuple[tuple[str, str, str], ...] = ()
    divisors: tuple[int, int] = (2, 10)
    rate: tuple[int, int] = (2, 30)  # per-item price / per-hour amount of "buy" and "earn"
    chain: bool = False


THEMES: tuple[Theme, ...] = (
    Theme(
        "shopping", "How many dollars does {name} have left?", (40, 300), 2000,
        intros=("{name} has ${a} to spend at the mall.", "{name} goes shopping with ${a} in {his} wallet."),
        products=(("{name} saved ${a} each week for {b} weeks and took it all to the mall.",
                   "{name} took {calc} dollars to the mall.", (5, 30), (2, 10)),),
        ops={
            "sub": (("{He} buys a pair of shoes for ${b}.", "After the shoes {he} has {calc} dollars."),
                    ("{He} pays ${b} for lunch.", "After lunch {he} has {calc} dollars."),
                    ("{He} buys a book for ${b}.", "After the book {he} has {calc} dollars.")),
            "add": (("{His} grandmother gives {him} ${b} more.", "With the gift {he} has {calc} dollars."),
                    ("{He} returns a sweater and gets ${b} back.", "After the refund {he} has {calc} dollars.")),
            "buy": (("{He} buys {k} T-shirts that cost ${b} each.",
                     "The T-shirts cost {calc1} dollars.\n{He} has {calc2} dollars left."),),
            "pct_off": (("{He} spends {b}% of {his} money on a backpack.",
                         "The backpack costs {calc1} dollars.\n{He} has {calc2} dollars left."),),
        },
        finals=(("div", "{He} splits the rest equally among {b} gift cards. How many dollars go on each card?",
                 "Each card gets {calc} dollars."),),
    ),
    Theme(
        "savings", "How many dollars does {name} have saved now?", (20, 400), 3000,
        intros=("{name} has ${a} in {his} piggy bank.",),
        products=(("{name} saves ${a} every week for {b} weeks.", "{name} saves {calc} dollars.",
                   (3, 25), (2, 12)),),
        ops={
            "add": (("{His} uncle adds ${b} to {his} savings.", "Now {he} has {calc} dollars."),
                    ("{He} earns ${b} mowing lawns and saves it.", "Now {he} has {calc} dollars.")),
            "sub": (("{He} spends ${b} on a video game.", "After the game {he} has {calc} dollars."),
                    ("{He} pays ${b} for a present for a friend.", "After the present {he} has {calc} dollars.")),
            "mul": (("{His} parents match {his} savings so that {he} ends up with {b} times as much.",
                     "{He} now has {calc} dollars."),),
            "pct_on": (("The bank pays {b}% interest on that amount.",
                        "The interest is {calc1} dollars.\nWith interest {he} has {calc2} dollars."),),
            "earn": (("{He} also earns ${b} an hour for {k} hours of babysitting and saves all of it.",
                      "Babysitting pays {calc1} dollars.\n{He} now has {calc2} dollars."),),
        },
        finals=(("div", "If {he} spends the same amount in each of the next {b} months until it is all gone, "
                 "how many dollars does {he} spend each month?", "{He} spends {calc} dollars each month."),),
    ),
    Theme(
        "baking", "How many cookies does {name} have for the bake sale?", (12, 150), 1500,
        intros=("{name} baked {a} cookies for a bake sale.",),
        products=(("{name} baked {a} trays of cookies with {b} cookies on each tray.",
                   "{name} baked {calc} cookies.", (2, 8), (6, 24)),),
        ops={
            "add": (("{He} baked another {b} cookies.", "Now there are {calc} cookies."),
                    ("{His} friend brought {b} cookies to add to the sale.", "Together they have {calc} cookies.")),
            "sub": (("{His} family ate {b} of the cookies.", "That leaves {calc} cookies."),
                    ("{b} cookies got burned and were thrown away.", "{calc} cookies were left.")),
            "div": (("{He} packed the cookies equally into {b} boxes and kept one box for the sale.",
                     "One box holds {calc} cookies."),),
        },
        finals=(("div", "{He} puts the cookies into bags of {b}. How many bags does {he} fill?",
                 "{He} fills {calc} bags."),),
    ),
    Theme(
        "ages", "How old is {cur}?", (4, 40), 100, chain=True,
        intros=("{name} is {a} years old.",),
        ops={
            "add": (("{cur} is {b} years older than {prev}.", "{cur} is {calc} years old."),),
            "sub": (("{cur} is {b} years younger than {prev}.", "{cur} is {calc} years old."),),
            "mul": (("{cur} is {b} times as old as {prev}.", "{cur} is {calc} years old."),),
            "div": (("{prev} is {b} times as old as {cur}.", "{cur} is {calc} years old."),),
        },
    ),
    Theme(
        "scores", "How many points did {cur} score?", (5, 80), 1000, chain=True,
        intros=("In a video game tournament, {name} scored {a} points.",),
        ops={
            "add": (("{cur} scored {b} more points than {prev}.", "{cur} scored {calc} points."),),
            "sub": (("{cur} scored {b} fewer points than {prev}.", "{cur} scored {calc} points."),),
            "mul": (("{cur} scored {b} times as many points as {prev}.", "{cur} scored {calc} points."),),
            "div": (("{prev} scored {b} times as many points as {cur}.", "{cur} scored {calc} points."),),
        },
    ),
    Theme(
        "travel", "How many miles has {name} traveled in total?", (10, 200), 3000, divisors=(5, 60), rate=(30, 65),
        intros=("{name} has already driven {a} miles today.",),
        products=(("{name} cycles at {a} miles per hour for {b} hours.", "{He} rides {calc} miles.",
                   (8, 20), (2, 6)),
                  ("{name} drives at {a} miles per hour for {b} hours.", "{He} drives {calc} miles.",
                   (30, 70), (2, 5))),
        ops={
            "add": (("Then {he} travels another {b} miles to the lake.", "So far {he} has traveled {calc} miles."),
                    ("{He} takes a {b}-mile detour to visit a friend.", "With the detour that is {calc} miles."),
                    ("On the way home {he} drives {b} more miles.", "Altogether that is {calc} miles.")),
            "earn": (("After a break {he} drives for {k} hours at {b} miles per hour.",
                      "That adds {calc1} miles.\nIn total {he} has traveled {calc2} miles."),),
            "mul": (("{He} makes that same trip {b} times this month.", "This month {he} travels {calc} miles."),),
        },
        finals=(("div", "If {he} had covered that whole distance at {b} miles per hour, how many hours would "
                 "it have taken?", "It would take {calc} hours."),),
    ),
    Theme(
        "classroom", "How many pencils does {name} have now?", (20, 200), 1500,
        intros=("{name}, a teacher, has {a} pencils in {his} classroom.",),
        products=(("{name}, a teacher, buys {a} boxes of pencils with {b} pencils in each box.",
                   "{name} has {calc} pencils.", (2, 12), (6, 24)),),
        ops={
            "sub": (("{b} of the pencils are broken and get thrown away.", "{calc} pencils are left."),
                    ("{His} students use up {b} pencils during a test.", "{He} has {calc} pencils left.")),
            "add": (("The principal gives {name} {b} more pencils.", "Now {he} has {calc} pencils."),
                    ("{He} finds {b} more pencils in a drawer.", "Now {he} has {calc} pencils.")),
            "div": (("{He} divides the pencils equally among {b} classrooms and keeps one share.",
                     "{His} share is {calc} pencils."),),
        },
        finals=(("div", "{He} shares the pencils equally among {b} students. How many pencils does each "
                 "student get?", "Each student gets {calc} pencils."),),
    ),
    Theme(
        "discounts", "How many dollars does {name} pay in total?", (20, 600), 5000,
        intros=("{name} wants to buy a bicycle that costs ${a}.", "{name} picks out a tablet priced at ${a}."),
        products=(("{name} orders {a} chairs for a party, and each chair costs ${b}.",
                   "The chairs cost {calc} dollars.", (2, 12), (10, 60)),),
        ops={
            "pct_off": (("The store takes {b}% off that price.",
                         "The discount is {calc1} dollars.\nThe price is now {calc2} dollars."),),
            "pct_on": (("Sales tax adds {b}% to the price.",
                        "The tax is {calc1} dollars.\nWith tax {he} pays {calc2} dollars."),),
            "sub": (("{He} also has a coupon for ${b} off.", "With the coupon {he} pays {calc} dollars."),),
            "add": (("Delivery costs an extra ${b}.", "With delivery {he} pays {calc} dollars."),),
            "mul": (("{He} needs the same purchase for {b} events.", "For all events {he} pays {calc} dollars."),),
        },
    ),
    Theme(
        "farm", "How many apples does {name} have now?", (20, 300), 2000,
        intros=("{name} picked {a} apples from {his} orchard.",),
        products=(("{name} has {a} apple trees, and each tree gives {b} apples.", "{name} gets {calc} apples.",
                   (3, 15), (10, 40)),),
        ops={
            "sub": (("{He} sells {b} apples at the market.", "{He} has {calc} apples left."),
                    ("{He} feeds {b} of the apples to {his} horses.", "{He} has {calc} apples left.")),
            "add": (("{His} neighbor gives {him} {b} more apples.", "Now {he} has {calc} apples."),),
            "div": (("{He} splits the apples equally into {b} crates and gives away all but one crate.",
                     "One crate holds {calc} apples."),),
            "pct_off": (("{He} uses {b}% of the apples to make pies.",
                         "The pies take {calc1} apples.\n{He} has {calc2} apples left."),),
        },
        finals=(("div", "{He} packs the apples into bags of {b}. How many bags does {he} fill?",
                 "{He} fills {calc} bags."),),
    ),
    Theme(
        "reading", "How many pages does {name} still have to read?", (60, 500), 1500,
        intros=("{name}'s book has {a} pages.",),
        products=(("{name} has to read {a} chapters, and each chapter has {b} pages.",
                   "{He} has {calc} pages to read.", (3, 15), (8, 30)),),
        ops={
            "sub": (("{He} reads {b} pages on the weekend.", "{calc} pages are left."),
                    ("{He} reads {b} pages on the bus.", "That leaves {calc} pages.")),
            "add": (("{His} teacher adds a bonus chapter of {b} pages.", "Now there are {calc} pages to read."),),
            "pct_off": (("On Monday {he} reads {b}% of the remaining pages.",
                         "{He} reads {calc1} pages on Monday.\nThat leaves {calc2} pages."),),
        },
        finals=(("div", "If {he} reads the remaining pages equally over {b} days, how many pages does {he} "
                 "read each day?", "{He} reads {calc} pages each day."),),
    ),
    Theme(
        "fundraiser", "How many dollars does the club have now?", (50, 500), 5000,
        intros=("{name}'s school club has ${a} in its account.",),
        products=(("{name}'s school club sells {a} raffle tickets at ${b} each.",
                   "The club raises {calc} dollars.", (10, 60), (2, 10)),),
        ops={
            "sub": (("The club pays ${b} for decorations.", "{calc} dollars are left."),
                    ("The club spends ${b} on a field trip.", "After the trip it has {calc} dollars.")),
            "add": (("A parent donates ${b}.", "With the donation the club has {calc} dollars."),
                    ("A bake sale brings in another ${b}.", "Now the club has {calc} dollars.")),
            "earn": (("The club also sells {k} cupcakes for ${b} each.",
                      "The cupcakes bring in {calc1} dollars.\nThe club now has {calc2} dollars."),),
            "buy": (("The club buys {k} banners that cost ${b} each.",
                     "The banners cost {calc1} dollars.\nThe club has {calc2} dollars left."),),
        },
        finals=(("div", "The club shares all of its money equally among {b} charities. How many dollars "
                 "does each charity get?", "Each charity gets {calc} dollars."),),
    ),
)
# fmt: on


def _small(theme: Theme) -> Theme:
    """The same story with every quantity below 120 and one-digit factors, rates and divisors.

    Why: a 135M model gets about a third of its 2-3-digit calculations right, so on default numbers
    GRPO groups are mostly all wrong (no signal); with small numbers the same SFT model answers about
    two thirds of one-operation problems, and a curriculum can start where the signal is.
    """
    return replace(
        theme,
        start=(5, 30),
        cap=min(theme.cap, 120),
        rate=(2, 9),
        products=tuple((q, s, (2, 9), (2, 5)) for q, s, _, _ in theme.products),
        divisors=(2, 5),
    )


_THEMES_BY_SIZE = {"default": THEMES, "small": tuple(_small(theme) for theme in THEMES)}
NUMBER_SIZES = tuple(_THEMES_BY_SIZE)
"""``numbers`` settings of :func:`generate_problems`: the default ranges, or ``small`` (below 120)."""
THEME_NAMES = tuple(theme.name for theme in THEMES)
"""The stories, in table order: ``themes`` of :func:`generate_problems` picks among them."""


# --------------------------------------------------------------------------- operation samplers
# Each returns (params, [(expression, result), ...], new value) or None when impossible for `v`.


def _add(rng: random.Random, v: int, t: Theme) -> Draw | None:
    hi = min(t.cap - v, max(10, v))
    b = rng.randint(2, hi) if hi >= 2 else 0
    return ({"b": b}, [(f"{v}+{b}", v + b)], v + b) if b else None


def _sub(rng: random.Random, v: int, t: Theme) -> Draw | None:
    b = rng.randint(max(1, v // 10), v - 2 if v > 2 else 1)  # keep >= 2 when possible ("1 points")
    return ({"b": b}, [(f"{v}-{b}", v - b)], v - b) if v >= 2 else None


def _mul(rng: random.Random, v: int, t: Theme) -> Draw | None:
    k = rng.choice([k for k in range(2, 6) if v * k <= t.cap] or [0])
    return ({"b": k}, [(f"{v}*{k}", v * k)], v * k) if k else None


def _div(rng: random.Random, v: int, t: Theme) -> Draw | None:
    k = rng.choice([k for k in range(t.divisors[0], t.divisors[1] + 1) if v % k == 0 and v > k] or [0])
    return ({"b": k}, [(f"{v}/{k}", v // k)], v // k) if k else None


def _buy(rng: random.Random, v: int, t: Theme) -> Draw | None:
    k = rng.choice([k for k in range(2, 9) if (v - 1) // k >= t.rate[0]] or [0])
    if not k:
        return None
    b = rng.randint(t.rate[0], min(t.rate[1], (v - 1) // k))
    return {"b": b, "k": k}, [(f"{k}*{b}", k * b), (f"{v}-{k * b}", v - k * b)], v - k * b


def _earn(rng: random.Random, v: int, t: Theme) -> Draw | None:
    k, b = rng.randint(2, 8), rng.randint(*t.rate)
    ok = v + k * b <= t.cap
    return ({"b": b, "k": k}, [(f"{k}*{b}", k * b), (f"{v}+{k * b}", v + k * b)], v + k * b) if ok else None


def _pct(sign: int) -> Callable[[random.Random, int, Theme], Draw | None]:
    def sample(rng: random.Random, v: int, t: Theme) -> Draw | None:
        p = rng.choice([p for p in _PERCENTS if v * p % 100 == 0 and v + sign * v * p // 100 <= t.cap] or [0])
        d, op = v * p // 100, "+" if sign > 0 else "-"
        return ({"b": p}, [(f"{v}*{p}/100", d), (f"{v}{op}{d}", v + sign * d)], v + sign * d) if p else None

    return sample


_SAMPLERS: dict[str, Callable[[random.Random, int, Theme], Draw | None]] = dict(
    add=_add, sub=_sub, mul=_mul, div=_div, buy=_buy, earn=_earn, pct_off=_pct(-1), pct_on=_pct(+1)
)


def _calc(expression: str, result: int) -> str:
    return f"{expression} = <<{expression}={result}>>{result}"


def _render(template: str, ctx: dict[str, Any], params: dict[str, int], calcs: list[tuple[str, int]]) -> str:
    extra = {f"calc{i}": _calc(expression, result) for i, (expression, result) in enumerate(calcs, start=1)}
    return template.format(**ctx, **params, **extra, calc=extra["calc1"])


def _try_problem(rng: random.Random, theme: Theme, n_ops: int) -> tuple[str, str, int] | None:
    """(question, solution, answer) with exactly ``n_ops`` annotated operations, or None if stuck."""
    name, gender = rng.choice(_PEOPLE)
    ctx: dict[str, Any] = {"name": name, **_PRONOUNS[gender]}
    others = iter(rng.sample([p for p, _ in _PEOPLE if p != name], n_ops)) if theme.chain else iter(())
    ctx["cur"] = name
    questions, solutions = [], []
    used: set[tuple[str, str]] = set()
    remaining = n_ops
    if theme.products and (not theme.intros or rng.random() < 0.5):
        q_tpl, s_tpl, a_range, b_range = rng.choice(theme.products)
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        value = a * b
        questions.append(q_tpl.format(a=a, b=b, **ctx))
        solutions.append(_render(s_tpl, ctx, {}, [(f"{a}*{b}", value)]))
        remaining -= 1
    else:
        value = rng.randint(*theme.start)
        questions.append(rng.choice(theme.intros).format(a=value, **ctx))
    closing = theme.question
    while remaining > 0:
        if remaining == 1 and theme.finals and rng.random() < 0.4:
            kind, q_tpl, s_tpl = rng.choice(theme.finals)
            drawn = _SAMPLERS[kind](rng, value, theme)
            if drawn is not None:
                params, calcs, value = drawn
                closing = q_tpl.format(**ctx, **params)
                solutions.append(_render(s_tpl, ctx, params, calcs))
                break
        # Unused phrasings first (a stable sort keeps the shuffled order otherwise): fewer repeats.
        options = [
            (kind, tpl) for kind, tpls in theme.ops.items() if _COST[kind] <= remaining for tpl in tpls
        ]
        rng.shuffle(options)
        options.sort(key=lambda option: option[1] in used)
        for kind, template in options:  # noqa: B007 - the break below keeps the chosen one
            drawn = _SAMPLERS[kind](rng, value, theme)
            if drawn is not None:
                break
        else:
            return None
        used.add(template)
        q_tpl, s_tpl = template
        params, calcs, value = drawn
        if theme.chain:
            ctx["prev"], ctx["cur"] = ctx["cur"], next(others)
        questions.append(q_tpl.format(**ctx, **params))
        solutions.append(_render(s_tpl, ctx, params, calcs))
        remaining -= _COST[kind]
    questions.append(closing.format(**ctx))
    solutions.append(f"#### {value}")
    return " ".join(questions), "\n".join(solutions), value


def generate_problems(
    num_examples: int,
    min_ops: int = 1,
    max_ops: int = 4,
    seed: int = 0,
    numbers: str = "default",
    themes: Sequence[str] | None = None,
) -> list[dict]:
    """``num_examples`` records (the :mod:`posttrain.core.gsm8k` schema), operations uniform in the range.

    ``numbers`` is a :data:`NUMBER_SIZES` entry; ``small`` problems get their own ids, so a small and a
    default set never share one. ``themes`` (names from :data:`THEME_NAMES`; None: all) keeps the
    stories a problem may come from, so a model trained on some stories can be evaluated on phrasings
    it never saw; a subset's ids name it, and naming every story is the same as None.

    >>> [p["id"] for p in generate_problems(2, seed=7)]
    ['synthetic-s7-0', 'synthetic-s7-1']
    >>> generate_problems(1, 2, 2)[0]["solution"].count("<<")
    2
    >>> generate_problems(1, numbers="small")[0]["id"]
    'synthetic-small-s0-0'
    >>> generate_problems(1, themes=["ages", "farm"])[0]["id"]
    'synthetic-ages+farm-s0-0'
    """
    if num_examples < 0:
        raise DataError(f"num_examples must be >= 0, got {num_examples}")
    if not 1 <= min_ops <= max_ops:
        raise DataError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
    if numbers not in _THEMES_BY_SIZE:
        raise DataError(f"numbers must be one of {', '.join(NUMBER_SIZES)}, got {numbers!r}")
    if themes is not None and not (themes and set(themes) <= set(THEME_NAMES)):
        raise DataError(f"themes must be some of {', '.join(THEME_NAMES)}, got {list(themes or ())}")
    # Table order, whatever order they were named in: the same set draws the same problems.
    all_themes = tuple(t for t in _THEMES_BY_SIZE[numbers] if themes is None or t.name in themes)
    prefix = "synthetic" if numbers == "default" else f"synthetic-{numbers}"
    if len(all_themes) < len(THEMES):
        prefix += "-" + "+".join(t.name for t in all_themes)
    records, seen, repeats = [], set(), 0
    for i in range(num_examples):
        rng = random.Random(f"posttrain-synthetic:{seed}:{i}")
        n_ops = rng.randint(min_ops, max_ops)
        usable = [t for t in all_themes if not t.chain or n_ops < len(_PEOPLE)]
        if not usable:
            raise DataError(
                f"themes {list(themes or ())} cannot tell a {n_ops}-operation problem (too few people)"
            )
        for attempt in range(1000):  # redraw repeats of earlier questions (held-out copies), up to a point
            made = _try_problem(rng, rng.choice(usable), n_ops)
            if made is not None and (made[0] not in seen or attempt >= 100):
                break
        else:  # pragma: no cover - every theme can always add, so this needs a broken template table
            raise DataError(f"could not generate a {n_ops}-operation problem (seed={seed}, index={i})")
        question, solution, answer = made
        repeats += question in seen
        seen.add(question)
        values = (f"{prefix}-s{seed}-{i}", question, solution, str(answer), n_ops, "synthetic")
        records.append(dict(zip(RECORD_FIELDS, values, strict=True)))
    if repeats:
        logger.warning(
            "%d of %d synthetic problems are repeats (too many for so few operations)", repeats, num_examples
        )
    return records
