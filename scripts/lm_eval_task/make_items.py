"""Write the items of the `pagellm_mc` lm-evaluation-harness task (deterministic, seeded).

300 four-way multiple-choice questions that a 135M model gets partly right: small additions,
capital cities, opposites, plural forms. No download: the JSONL is written next to this file
(items.jsonl) and read by pagellm_mc.yaml through lm-eval's `json` dataset builder.
With --num-items N > 300 the same 300 come first, then N - 300 more (reverse capitals, times
tables, two-digit sums and differences), for a finer comparison between two engines or caches.
Usage: python make_items.py [OUT.jsonl] [--num-items N]
"""
import argparse
import json
import os
import random

SEED = 1234

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi",
    "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna",
    "Hungary": "Budapest", "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Switzerland": "Bern",
    "Turkey": "Ankara", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Thailand": "Bangkok",
    "South Korea": "Seoul", "Vietnam": "Hanoi", "Cuba": "Havana", "Iran": "Tehran", "Iraq": "Baghdad",
    "the United Kingdom": "London", "the United States": "Washington", "Colombia": "Bogota",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "happy": "sad", "light": "dark",
    "old": "young", "open": "closed", "full": "empty", "hard": "soft", "high": "low", "rich": "poor",
    "early": "late", "strong": "weak", "wet": "dry", "long": "short", "clean": "dirty", "loud": "quiet",
    "heavy": "light", "thick": "thin", "good": "bad", "true": "false", "inside": "outside", "day": "night",
    "win": "lose", "buy": "sell", "push": "pull", "love": "hate", "begin": "end", "left": "right",
    "north": "south", "east": "west", "above": "below", "first": "last", "near": "far",
}
PLURALS = {
    "cat": "cats", "dog": "dogs", "box": "boxes", "child": "children", "mouse": "mice", "man": "men",
    "woman": "women", "foot": "feet", "tooth": "teeth", "goose": "geese", "city": "cities", "baby": "babies",
    "leaf": "leaves", "knife": "knives", "wolf": "wolves", "bus": "buses", "glass": "glasses",
    "potato": "potatoes", "tomato": "tomatoes", "person": "people", "sheep": "sheep", "fish": "fish",
    "book": "books", "church": "churches", "wife": "wives", "party": "parties", "hero": "heroes",
    "ox": "oxen", "calf": "calves", "life": "lives", "dish": "dishes", "story": "stories", "key": "keys",
    "toy": "toys", "day": "days",
}


def plural_distractors(word, right, rng):
    cands = {word + "s", word + "es", word + "en", word[:-1] + "ies" if word.endswith("y") else word + "ies",
             word + "ves", right + "s", word}
    cands.discard(right)
    cands = sorted(cands)
    rng.shuffle(cands)
    return cands[:3]


def make(rng):
    items = []
    # 120 additions / subtractions with small numbers; distractors are near misses
    for _ in range(120):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if rng.random() < 0.5:
            q, ans = f"What is {a} plus {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            q, ans = f"What is {a} minus {b}?", a - b
        wrong = set()
        while len(wrong) < 3:
            w = ans + rng.choice([-3, -2, -1, 1, 2, 3, 10])
            if w >= 0 and w != ans:
                wrong.add(w)
        items.append(("arithmetic", q, str(ans), [str(w) for w in sorted(wrong)]))
    countries = sorted(CAPITALS)
    for c in countries:
        others = [CAPITALS[o] for o in countries if o != c]
        items.append(("capital", f"What is the capital of {c}?", CAPITALS[c], rng.sample(others, 3)))
    words = sorted(OPPOSITES)
    for w in words:
        others = sorted({OPPOSITES[o] for o in words if o != w} - {OPPOSITES[w], w})
        items.append(("opposite", f"What is the opposite of \"{w}\"?", OPPOSITES[w], rng.sample(others, 3)))
    nouns = sorted(PLURALS)
    for n in nouns:
        items.append(("plural", f"What is the plural of \"{n}\"?", PLURALS[n], plural_distractors(n, PLURALS[n], rng)))
    # top up to 300 with more arithmetic (two-digit additions)
    while len(items) < 300:
        a, b = rng.randint(10, 60), rng.randint(10, 40)
        ans = a + b
        wrong = sorted({ans + d for d in rng.sample([-11, -10, -2, -1, 1, 2, 9, 10], 3)})
        items.append(("arithmetic", f"What is {a} plus {b}?", str(ans), [str(w) for w in wrong]))
    return shuffled(items, rng)


def near_misses(ans, rng, steps=(-11, -10, -2, -1, 1, 2, 9, 10)):
    return sorted({ans + d for d in rng.sample(steps, 3)} - {ans})


def extra(num_items, rng):
    """Items past the first 300, from their own generator so that those stay byte for byte."""
    items = []
    capitals = sorted(CAPITALS)
    for c in capitals:
        others = [o for o in capitals if o != c]
        items.append(("capital", f"Which country has {CAPITALS[c]} as its capital?", c, rng.sample(others, 3)))
    while len(items) < num_items:
        kind = len(items) % 3
        if kind == 0:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            q, ans = f"What is {a} times {b}?", a * b
            wrong = sorted({ans + d for d in rng.sample([-a, -b, -2, -1, 1, 2, a, b], 3)} - {ans})
        elif kind == 1:
            a, b = rng.randint(10, 80), rng.randint(10, 80)
            q, ans = f"What is {a} plus {b}?", a + b
            wrong = near_misses(ans, rng)
        else:
            a, b = rng.randint(30, 99), rng.randint(10, 29)
            q, ans = f"What is {a} minus {b}?", a - b
            wrong = near_misses(ans, rng)
        if len(wrong) == 3 and min(wrong) >= 0:
            items.append(("arithmetic", q, str(ans), [str(w) for w in wrong]))
    return items[:num_items]


def shuffled(items, rng, first_id=0):
    out = []
    for i, (kind, q, right, wrong) in enumerate(items, start=first_id):
        assert right not in wrong and len(set(wrong)) == 3, (q, right, wrong)
        choices = [right] + list(wrong)
        rng.shuffle(choices)
        out.append({"id": i, "kind": kind, "question": q, "choices": choices, "label": choices.index(right)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "items.jsonl"))
    ap.add_argument("--num-items", type=int, default=300)
    args = ap.parse_args()
    path = args.out
    items = make(random.Random(SEED))
    if args.num_items > len(items):
        rng = random.Random(SEED + 1)
        items += shuffled(extra(args.num_items - len(items), rng), rng, first_id=len(items))
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    print(f"wrote {len(items)} items to {path}")


if __name__ == "__main__":
    main()
