#!/usr/bin/env python3
"""make_corpus.py: generate the small demo corpus in data/ (deterministic, stdlib only, no downloads).

Writes data/corpus.txt (~400 KB of English-like ASCII with learnable structure: a small
grammar with number agreement, arithmetic facts such as "3 plus 4 is 7.", days and months
in order, counting, and fixed facts about colors and animals), then data/corpus_train.bin
(first 90% of the bytes) and data/corpus_val.bin (last 10%) in the byte-level llm.c token
shard format via txt_to_bin.py. A byte-level model learns this well below the unigram
entropy within a few hundred steps. Runs in about a second.
"""
import os
import random
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from txt_to_bin import convert  # noqa: E402

SEED = 1234
TARGET_BYTES = 400_000
VAL_FRACTION = 0.1

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december"]
# noun -> (plural, what it eats, its sound)
ANIMALS = {"cat": ("cats", "fish", "meows"), "dog": ("dogs", "meat", "barks"),
           "cow": ("cows", "grass", "moos"), "bird": ("birds", "seeds", "sings"),
           "horse": ("horses", "hay", "neighs"), "mouse": ("mice", "cheese", "squeaks"),
           "rabbit": ("rabbits", "carrots", "thumps"), "duck": ("ducks", "bread", "quacks")}
PEOPLE = ["the girl", "the boy", "the teacher", "the farmer", "my sister", "my brother",
          "the old man", "the young woman", "anna", "tom", "lisa", "ben"]
THINGS = {"ball": "red", "apple": "green", "sky": "blue", "sun": "yellow", "grass": "green",
          "snow": "white", "night": "black", "orange": "orange", "banana": "yellow",
          "cherry": "red", "sea": "blue", "coal": "black"}
ADJECTIVES = ["small", "big", "happy", "sleepy", "old", "young", "quick", "lazy", "brown", "tiny"]
PLACES = ["in the garden", "on the farm", "by the river", "in the house", "at the park",
          "near the barn", "under the tree", "on the hill"]
VERBS = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("finds", "find"),
         ("watches", "watch")]  # (singular, plural)


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def arithmetic(r: random.Random) -> str:
    op = r.choice(["plus", "minus", "times"])
    a, b = r.randint(0, 12), r.randint(0, 12)
    if op == "plus":
        return f"{a} plus {b} is {a + b}."
    if op == "minus":
        a, b = max(a, b), min(a, b)
        return f"{a} minus {b} is {a - b}."
    a, b = a % 10, b % 10
    return f"{a} times {b} is {a * b}."


def calendar(r: random.Random) -> str:
    kind = r.randrange(4)
    if kind == 0:
        i = r.randrange(7)
        return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if kind == 1:
        i = r.randrange(12)
        return f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}."
    if kind == 2:
        i = r.randrange(7)
        n = r.randint(3, 5)
        return "The days are " + ", ".join(DAYS[(i + k) % 7] for k in range(n)) + "."
    i = r.randrange(9)
    n = r.randint(3, 4)
    return "We count " + ", ".join(NUMBER_WORDS[i + k] for k in range(n)) + "."


def animal_fact(r: random.Random) -> str:
    a = r.choice(list(ANIMALS))
    plural, food, sound = ANIMALS[a]
    kind = r.randrange(3)
    if kind == 0:
        return f"The {a} eats {food}. {cap(plural)} eat {food}."
    if kind == 1:
        return f"The {r.choice(ADJECTIVES)} {a} {sound} {r.choice(PLACES)}."
    n = r.randint(2, 9)
    return f"There are {NUMBER_WORDS[n]} {plural} {r.choice(PLACES)}. I see {n} {plural}."


def color_fact(r: random.Random) -> str:
    t = r.choice(list(THINGS))
    if r.random() < 0.5:
        return f"What color is the {t}? The {t} is {THINGS[t]}."
    return f"{cap(r.choice(PEOPLE))} has a {THINGS[t]} {t}." if t in ("ball", "apple", "banana", "cherry", "orange") \
        else f"The {t} is {THINGS[t]}."


def clause(r: random.Random) -> str:
    """Subject-verb-object with singular/plural agreement."""
    a = r.choice(list(ANIMALS))
    verb_s, verb_p = r.choice(VERBS)
    obj = r.choice(PEOPLE + [f"the {r.choice(list(ANIMALS))}"])
    if r.random() < 0.5:
        subj, verb = f"the {r.choice(ADJECTIVES)} {a}", verb_s
    else:
        subj, verb = f"the {ANIMALS[a][0]}", verb_p
    return cap(f"{subj} {verb} {obj} {r.choice(PLACES)}.")


def story(r: random.Random) -> str:
    who = r.choice(PEOPLE)
    day = r.randrange(7)
    a = r.choice(list(ANIMALS))
    n = r.randint(1, 6)
    m = r.randint(1, 6)
    return (f"On {DAYS[day]}, {who} went {r.choice(PLACES)}. {cap(who)} saw {n} "
            f"{ANIMALS[a][0] if n > 1 else a} and {m} more. That makes {n + m}. "
            f"The next day was {DAYS[(day + 1) % 7]}.")


GENERATORS = [arithmetic, calendar, animal_fact, color_fact, clause, story]


def make_text(seed: int = SEED, target: int = TARGET_BYTES) -> str:
    r = random.Random(seed)
    paragraphs, size = [], 0
    while size < target:
        para = " ".join(r.choice(GENERATORS)(r) for _ in range(r.randint(3, 7)))
        paragraphs.append(para)
        size += len(para) + 1
    return "\n".join(paragraphs) + "\n"


def main() -> int:
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    os.makedirs(data_dir, exist_ok=True)
    txt = os.path.join(data_dir, "corpus.txt")
    with open(txt, "w", encoding="ascii", newline="\n") as f:
        f.write(make_text())
    n_train, n_val = convert(txt, os.path.join(data_dir, "corpus_train.bin"), VAL_FRACTION,
                             os.path.join(data_dir, "corpus_val.bin"))
    print(f"make_corpus: data/corpus.txt {n_train + n_val} bytes; train {n_train}, val {n_val} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
