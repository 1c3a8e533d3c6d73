"""The requests of the speculative-decoding benchmark (bench_spec.py): a fixed, deterministic set of chat
requests, in two families.

* Input-grounded: most of the answer is already in the prompt, so a draft taken from the sequence's own
  tokens (n-gram speculation) is often right.
    - "code": an 80-line Python module and "rename function X to Y, change nothing else, output the whole
      file" (about 800 tokens of output, nearly all copied);
    - "summary": a ~600-word article and "summarize, quoting the key sentences verbatim";
    - "document": a service manual and a question, "answer quoting the relevant passage".
* Free text ("free"): a story and an essay with no source text; a draft from the prompt rarely matches, so
  speculation should cost next to nothing here.

SEQUENTIAL is one request of each kind (two free ones), sent one at a time. CONCURRENT is eight distinct
requests of all kinds, sent at once to a server with 8 slots. Every request is greedy (the benchmark sets
temperature 0); max_tokens leaves room for the whole rewrite of the code.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONCURRENT", "GROUNDED", "KINDS", "SEQUENTIAL", "SpecRequest"]

KINDS = ("code", "summary", "document", "free")
GROUNDED = ("code", "summary", "document")


@dataclass(frozen=True)
class SpecRequest:
    """One chat request: `name` (unique), `kind` (one of KINDS), the chat `messages`, and `max_tokens`."""

    name: str
    kind: str
    messages: tuple[dict, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens}: at least 1")

    def body(self) -> dict:
        """The JSON body of a greedy, streamed /v1/chat/completions request."""
        return {"messages": [dict(m) for m in self.messages], "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}


CODE_FILE = '''\
"""Inventory records: load them from CSV, check them, and report what must be reordered."""
import csv
from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    reorder_level: int
    unit_price: float


def parse_line(row):
    """Turn one CSV row into an Item; raise ValueError on a bad row."""
    if len(row) != 5:
        raise ValueError(f"expected 5 fields, got {len(row)}")
    sku, name, quantity, reorder_level, unit_price = row
    return Item(sku.strip(), name.strip(), int(quantity), int(reorder_level), float(unit_price))


def load_items(path):
    """Read every item of a CSV file (with a header line)."""
    items = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            if row:
                items.append(parse_line(row))
    return items


def validate(items):
    """Return a list of problems: duplicate SKUs, negative quantities, zero prices."""
    problems = []
    seen = set()
    for item in items:
        if item.sku in seen:
            problems.append(f"duplicate sku {item.sku}")
        seen.add(item.sku)
        if item.quantity < 0:
            problems.append(f"negative quantity for {item.sku}")
        if item.unit_price <= 0:
            problems.append(f"bad price for {item.sku}")
    return problems


def needs_reorder(item):
    """True when the stock is at or below the reorder level."""
    return item.quantity <= item.reorder_level


def stock_value(items):
    """The total value of the stock, in the currency of the prices."""
    total = 0.0
    for item in items:
        total += item.quantity * item.unit_price
    return round(total, 2)


def reorder_report(items):
    """One line per item to reorder, sorted by SKU."""
    lines = []
    for item in sorted(items, key=lambda i: i.sku):
        if needs_reorder(item):
            missing = item.reorder_level - item.quantity + 1
            lines.append(f"{item.sku}  {item.name:<20}  order {missing}")
    return lines


def main(path):
    items = load_items(path)
    problems = validate(items)
    for problem in problems:
        print("warning:", problem)
    print(f"{len(items)} items, stock value {stock_value(items):.2f}")
    for line in reorder_report(items):
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1]))
'''

ARTICLE = """\
For most of the nineteenth century, the lighthouse keeper was one of the loneliest workers in the \
public service. A keeper and his family lived at the foot of the tower, often on a rock several miles \
from the mainland, and the supply boat came once a fortnight when the weather allowed it. The work was \
simple to describe and hard to do well. The lamp had to be lit at sunset and put out at sunrise, the wick \
had to be trimmed every few hours, and the great lens had to be kept free of soot and salt. A single \
night of darkness could cost a ship and every life on board.

The light itself changed more in that century than in the two thousand years before it. Early towers \
burned wood or coal in open braziers, and their glow was weak and unsteady. Oil lamps with reflectors \
were a large step forward, but most of the light still escaped in the wrong directions. The decisive \
change came in 1822, when the French engineer Augustin Fresnel showed that a lens built from concentric \
rings of glass could bend nearly all of the light into a single horizontal beam. A Fresnel lens of the \
first order stood taller than a man and could be seen more than twenty miles out to sea. Within a few \
decades, almost every important coast in Europe and North America had one.

Each lighthouse also needed a way to be recognized. A sailor who saw a light at night had to know which \
light it was, or he could not fix his position. Engineers solved this by giving every station its own \
character: a fixed light, a light that flashed once every ten seconds, a group of two flashes, a red \
sector over a dangerous shoal. The characters were printed in official lists that every navigator \
carried. In fog, when no light could be seen, the stations sounded bells, whistles or horns, again in \
patterns that identified them.

The keepers' lives were governed by strict rules. They kept a logbook in which they recorded the \
weather, the ships that passed, the oil they burned and every fault of the apparatus. Inspectors arrived \
without warning and checked the brass, the glass and the books. A keeper who let the light fail could be \
dismissed on the spot. Many keepers served for decades at the same station, and it was common for sons \
and daughters to take over the post from their parents. Several of the most famous rescues of the era \
were carried out by keepers who rowed out in storms to reach a wreck.

Electricity began to replace oil at the end of the century, first at the largest stations and then \
everywhere. An electric lamp needed no trimming, and it could be switched on and off by a clock. In the \
twentieth century, radio beacons and later satellite navigation took over much of the work that the \
lights had done alone. One by one, the stations were automated, and the last keepers left their towers. \
In Britain the final manned lighthouse was automated in 1998.

Today most lighthouses still shine, but nobody lives beside them. Some have become museums, holiday \
cottages or bird observatories, and volunteers maintain many of the smaller towers. The lenses that \
Fresnel designed remain in use at hundreds of stations, because no better way has been found to send a \
beam of light across the water. The keepers are gone, but the logbooks they kept are still read by \
historians, who find in them a detailed record of two centuries of weather, shipping and life at the \
edge of the sea.
"""

MANUAL = """\
ACME R-200 Robot Vacuum: Service Manual (excerpt)

Section 1. Charging. The R-200 returns to its dock when the battery falls below 15 percent. A full charge \
takes about four hours from empty. The status light on the dock is green while charging and turns off \
when the battery is full. If the status light blinks red, the charging contacts are dirty: wipe them with \
a dry cloth and place the vacuum back on the dock.

Section 2. Brushes and filter. The main brush should be cleaned once a week and replaced every six to \
twelve months. The side brush should be replaced every three to six months. The filter must be emptied \
after every run and replaced every two months; never wash the filter with water, because a wet filter \
damages the motor.

Section 3. Error codes. Error E1 means that a wheel is stuck: lift the vacuum and check the wheels for \
hair or string. Error E2 means that the bumper is jammed: press the bumper several times until it moves \
freely. Error E3 means that the cliff sensors are dirty: wipe the four sensors on the underside with a \
soft dry cloth. Error E4 means that the main brush cannot turn: remove the brush, cut away any tangled \
hair, and refit it. Error E5 means that the battery is overheating: switch the vacuum off and let it \
cool for one hour before charging it again. If an error code returns after these steps, contact an \
authorized service center.

Section 4. Warranty. The R-200 carries a two-year warranty from the date of purchase. The battery is \
covered for one year. The warranty does not cover damage caused by water, by using the vacuum outdoors, \
or by repairs made outside an authorized service center. Keep the receipt: it is required for every \
warranty claim.

Section 5. Storage. If the R-200 will not be used for more than a month, charge the battery fully, switch \
the vacuum off with the power switch on its side, and store it in a cool, dry place. Recharge it at least \
once every three months to protect the battery.
"""


def _code(old: str, new: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": "You are a careful programming assistant."},
            {"role": "user", "content": f"Here is a Python file:\n\n```python\n{CODE_FILE}```\n\nRename the "
             f"function `{old}` to `{new}` (its definition and every call) and change nothing else. Output the "
             f"whole file in one ```python block, with no comments before or after it."})


def _summary(ask: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": f"{ARTICLE}\n{ask}"},)


def _document(question: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": "Answer from the document only. Quote the relevant passage "
             "verbatim, in quotation marks, then give the answer in one sentence."},
            {"role": "user", "content": f"Document:\n\n{MANUAL}\nQuestion: {question}"})


def _free(ask: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": ask},)


SUMMARY_ASK = ("Summarize the text above in one paragraph. Quote the key sentences verbatim, in quotation "
               "marks.")
STORY = ("Write a short story about a girl who finds an old map in her grandmother's attic and follows it "
         "through the town.")
ESSAY = "Write an essay about why people enjoy gardening, with an introduction, three arguments and a conclusion."

SEQUENTIAL: tuple[SpecRequest, ...] = (
    SpecRequest("code-rename", "code", _code("parse_line", "parse_record"), 1000),
    SpecRequest("summary-quote", "summary", _summary(SUMMARY_ASK), 400),
    SpecRequest("document-e3", "document", _document("What does error E3 mean and what should I do?"), 300),
    SpecRequest("free-story", "free", _free(STORY), 400),
    SpecRequest("free-essay", "free", _free(ESSAY), 400),
)

CONCURRENT: tuple[SpecRequest, ...] = (
    SEQUENTIAL[0],
    SpecRequest("code-rename-2", "code", _code("needs_reorder", "is_low_stock"), 1000),
    SEQUENTIAL[1],
    SpecRequest("summary-points", "summary", _summary(
        "List the three most important points of the text above. For each one, quote verbatim, in "
        "quotation marks, the sentence that states it."), 400),
    SEQUENTIAL[2],
    SpecRequest("document-warranty", "document", _document(
        "Is damage from water covered by the warranty, and what do I need to make a claim?"), 300),
    SEQUENTIAL[3],
    SEQUENTIAL[4],
)

assert len({r.name for r in SEQUENTIAL + CONCURRENT}) == len({id(r) for r in SEQUENTIAL + CONCURRENT})
