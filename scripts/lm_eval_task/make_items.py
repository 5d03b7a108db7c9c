"""Write the items of the `pagellm_mc` lm-evaluation-harness task (deterministic, seeded).

300 four-way multiple-choice questions that a 135M model gets partly right: small additions,
capital cities, opposites, plural forms. No download: the JSONL is written next to this file
(items.jsonl) and read by pagellm_mc.yaml through lm-eval's `json` dataset builder.
Usage: python make_items.py [OUT.jsonl]
"""
import json
import os
import random
import sys

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
    out = []
    for i, (kind, q, right, wrong) in enumerate(items):
        assert right not in wrong and len(set(wrong)) == 3, (q, right, wrong)
        choices = [right] + list(wrong)
        rng.shuffle(choices)
        out.append({"id": i, "kind": kind, "question": q, "choices": choices, "label": choices.index(right)})
    return out


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "items.jsonl")
    items = make(random.Random(SEED))
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    print(f"wrote {len(items)} items to {path}")


if __name__ == "__main__":
    main()
