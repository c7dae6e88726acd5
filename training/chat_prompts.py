"""Varied chat prompts built here, for distilling a draft from a chat target.

No data set is downloaded: prompts are instructions (explain, list, write,
compare, rewrite, code, arithmetic, ...) crossed with subjects from many
domains, deduplicated and split deterministically into train and held-out
sets. Held-out prompts use subjects that no training prompt uses, so
acceptance measured on them is measured on topics the draft never saw.
"""

from __future__ import annotations

import hashlib
import itertools
import random

SUBJECTS = {
    "science": [
        "photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA replication",
        "the immune system", "climate change", "volcanoes", "magnetism", "electricity",
        "the solar system", "gravity", "evolution", "the periodic table", "vaccines",
        "earthquakes", "the human heart", "bacteria", "rainbows", "ocean tides", "atoms",
        "the moon", "weather forecasting", "renewable energy", "the speed of light", "fossils",
        "the nervous system", "sound waves", "chemical reactions", "the greenhouse effect",
    ],
    "technology": [
        "the internet", "machine learning", "smartphones", "computer viruses", "cloud computing",
        "blockchain", "electric cars", "3D printing", "password security", "search engines",
        "databases", "operating systems", "compilers", "web browsers", "solar panels",
        "robots", "GPS", "email", "video games", "social media", "open source software",
        "wifi", "batteries", "satellites", "encryption", "programming languages",
    ],
    "daily life": [
        "cooking pasta", "saving money", "learning a new language", "getting better sleep",
        "staying hydrated", "making friends", "time management", "gardening", "moving to a new city",
        "cleaning a kitchen", "planning a trip", "writing a resume", "job interviews",
        "public speaking", "exercising at home", "reducing stress", "reading more books",
        "taking care of a dog", "budgeting for groceries", "learning to swim", "baking bread",
        "organizing a closet", "riding a bicycle", "healthy breakfasts", "recycling",
    ],
    "history and society": [
        "the Roman Empire", "the printing press", "the industrial revolution", "ancient Egypt",
        "the Olympic Games", "democracy", "the Silk Road", "the invention of writing",
        "the Renaissance", "the first moon landing", "libraries", "money", "the postal service",
        "museums", "national parks", "elections", "the history of tea", "castles", "trains",
        "the Great Wall of China", "pirates", "the Vikings", "music festivals", "city planning",
    ],
    "arts and culture": [
        "poetry", "jazz music", "painting with watercolors", "photography", "theater",
        "the guitar", "science fiction novels", "folk tales", "dancing", "sculpture",
        "film making", "comic books", "classical music", "architecture", "board games",
        "chess", "origami", "knitting", "calligraphy", "stand-up comedy",
    ],
    "nature": [
        "bees", "elephants", "rainforests", "deserts", "coral reefs", "migrating birds",
        "octopuses", "mountains", "rivers", "penguins", "mushrooms", "wolves", "whales",
        "butterflies", "oak trees", "cats", "dolphins", "ants", "snow", "sunflowers",
    ],
    "programming": [
        "recursion", "sorting a list", "Python dictionaries", "unit tests", "git branches",
        "linked lists", "binary search", "regular expressions", "JSON", "HTTP requests",
        "error handling", "classes and objects", "loops", "variables", "hash tables",
        "SQL queries", "APIs", "debugging", "big O notation", "string formatting",
    ],
}

TEMPLATES = [
    "Explain {s} in simple terms.",
    "What is {s}?",
    "Can you tell me about {s}?",
    "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "Why is {s} important?",
    "Explain {s} to a ten-year-old.",
    "What are the main advantages and disadvantages of {s}?",
    "Write a short poem about {s}.",
    "List five key points about {s}.",
    "How would you describe {s} to someone who has never heard of it?",
    "Write a short story that involves {s}.",
    "What are some common misconceptions about {s}?",
    "Give me a simple tip about {s}.",
    "Summarize what people should know about {s} in two sentences.",
    "What questions would a student ask about {s}? List a few.",
    "Write a tweet about {s}.",
    "Describe the history of {s} briefly.",
    "How does {s} affect everyday life?",
    "Write an email to a friend recommending they learn about {s}.",
    "Compare {s} and {t}.",
    "What do {s} and {t} have in common?",
    "Write a haiku about {s}.",
    "Give me a step-by-step guide related to {s}.",
    "I am curious about {s}. Where should I start?",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "How do I {c} in Python?",
    "Show me a short example of code that {c}, and explain it.",
]
CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "counts the vowels in a word",
    "returns the largest number in a list", "computes the factorial of n", "sorts a list of names",
    "removes duplicates from a list", "checks if a word is a palindrome", "sums the digits of a number",
    "converts Celsius to Fahrenheit", "finds the average of a list", "reads a text file line by line",
    "counts words in a sentence", "merges two dictionaries", "generates the Fibonacci sequence",
    "checks whether a year is a leap year", "finds the second smallest number in a list",
    "capitalizes every word in a sentence", "flattens a nested list", "computes the GCD of two numbers",
]

ARITHMETIC_TEMPLATES = [
    "What is {a} + {b}?",
    "What is {a} plus {b}? Answer with the number.",
    "Calculate {a} + {b}.",
    "If I have {a} apples and buy {b} more, how many apples do I have?",
]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _subject_is_heldout(subject: str) -> bool:
    return _hash("subject:" + subject) % 8 == 0


def all_prompts() -> tuple[list[str], list[str]]:
    """(train, held-out) user messages; deterministic, deduplicated.

    A prompt is held out when its (first) subject is: about 1 in 8 subjects,
    so the held-out set covers every domain with topics training never saw.
    """
    rng = random.Random(0)
    subjects = [s for group in SUBJECTS.values() for s in group]
    train, heldout = [], []
    for template, s in itertools.product(TEMPLATES, subjects):
        t = rng.choice([x for x in subjects if x != s])
        text = template.format(s=s, t=t)
        (heldout if _subject_is_heldout(s) else train).append(text)
    for template, c in itertools.product(CODE_TEMPLATES, CODE_TASKS):
        (heldout if _subject_is_heldout(c) else train).append(template.format(c=c))
    for i in range(400):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        text = rng.choice(ARITHMETIC_TEMPLATES).format(a=a, b=b)
        (heldout if _hash(text) % 8 == 0 else train).append(text)
    train = list(dict.fromkeys(train))
    heldout = list(dict.fromkeys(heldout))
    random.Random(1).shuffle(train)
    random.Random(2).shuffle(heldout)
    return train, heldout


def train_prompts() -> list[str]:
    return all_prompts()[0]


def heldout_prompts() -> list[str]:
    return all_prompts()[1]


# ----------------------------------------------------------------------------- the verifiable task

CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Germany", "Berlin"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("England", "London"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"), ("Hungary", "Budapest"), ("Thailand", "Bangkok"), ("Cuba", "Havana"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Mexico", "Mexico City"), ("India", "New Delhi"),
    ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Iran", "Tehran"),
    ("Iraq", "Baghdad"), ("Turkey", "Ankara"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"), ("Czech Republic", "Prague"), ("Ukraine", "Kyiv"), ("Vietnam", "Hanoi"),
]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("happy", "sad"),
    ("fast", "slow"), ("old", "young"), ("light", "dark"), ("open", "closed"), ("hard", "soft"),
    ("wet", "dry"), ("full", "empty"), ("early", "late"), ("rich", "poor"), ("strong", "weak"),
    ("high", "low"), ("left", "right"), ("begin", "end"), ("win", "lose"), ("push", "pull"),
    ("true", "false"), ("heavy", "light"), ("inside", "outside"), ("above", "below"), ("love", "hate"),
    ("clean", "dirty"), ("loud", "quiet"), ("thick", "thin"), ("buy", "sell"), ("north", "south"),
]


def task_items() -> list[dict]:
    """Short questions with one verifiable answer that SmolLM2-135M-Instruct
    often gets right: capitals, single-digit sums, opposites (150 items)."""
    items = [{"prompt": f"What is the capital of {c}?", "answer": a} for c, a in CAPITALS]
    items += [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
              for a in range(1, 10) for b in range(1, 10) if (a * 7 + b * 3) % 9 < 7][:80]
    items += [{"prompt": f"What is the opposite of {w}? Answer with one word.", "answer": o} for w, o in OPPOSITES]
    random.Random(3).shuffle(items)
    return items


# PAD's pivot head learns on questions of the same kinds that the evaluation never asks
# (pivot_task_items); answers avoid accents and disputed or renamed capitals.
TRAIN_CAPITALS = [
    ("Australia", "Canberra"), ("Venezuela", "Caracas"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"),
    ("Nepal", "Kathmandu"), ("Afghanistan", "Kabul"), ("Saudi Arabia", "Riyadh"), ("Syria", "Damascus"),
    ("Lebanon", "Beirut"), ("Jordan", "Amman"), ("Morocco", "Rabat"), ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"), ("Libya", "Tripoli"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("Ethiopia", "Addis Ababa"), ("Uganda", "Kampala"), ("Zimbabwe", "Harare"), ("Zambia", "Lusaka"),
    ("Senegal", "Dakar"), ("Sudan", "Khartoum"), ("Somalia", "Mogadishu"), ("Angola", "Luanda"),
    ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"),
    ("Estonia", "Tallinn"), ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Belarus", "Minsk"),
    ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"), ("Uzbekistan", "Tashkent"), ("North Korea", "Pyongyang"),
    ("Taiwan", "Taipei"), ("Malaysia", "Kuala Lumpur"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"),
    ("New Zealand", "Wellington"), ("Jamaica", "Kingston"), ("Ecuador", "Quito"), ("Uruguay", "Montevideo"),
    ("Panama", "Panama City"), ("Guatemala", "Guatemala City"), ("Honduras", "Tegucigalpa"),
    ("Nicaragua", "Managua"), ("Malta", "Valletta"), ("Cyprus", "Nicosia"), ("Albania", "Tirana"),
    ("Qatar", "Doha"), ("Kuwait", "Kuwait City"), ("Oman", "Muscat"), ("the United Arab Emirates", "Abu Dhabi"),
    ("Mali", "Bamako"), ("Niger", "Niamey"), ("Madagascar", "Antananarivo"), ("Mozambique", "Maputo"),
    ("Namibia", "Windhoek"), ("Botswana", "Gaborone"), ("Rwanda", "Kigali"), ("the United States", "Washington"),
]
TRAIN_OPPOSITES = [
    ("good", "bad"), ("near", "far"), ("first", "last"), ("black", "white"), ("new", "old"),
    ("sweet", "sour"), ("cheap", "expensive"), ("easy", "difficult"), ("safe", "dangerous"), ("asleep", "awake"),
    ("give", "take"), ("laugh", "cry"), ("arrive", "leave"), ("remember", "forget"), ("accept", "reject"),
    ("increase", "decrease"), ("before", "after"), ("always", "never"), ("yes", "no"), ("boy", "girl"),
    ("king", "queen"), ("father", "mother"), ("brother", "sister"), ("husband", "wife"), ("east", "west"),
    ("summer", "winter"), ("friend", "enemy"), ("question", "answer"), ("war", "peace"), ("alive", "dead"),
    ("deep", "shallow"), ("wide", "narrow"), ("smooth", "rough"), ("polite", "rude"), ("floor", "ceiling"),
    ("entrance", "exit"), ("input", "output"), ("maximum", "minimum"), ("positive", "negative"),
    ("odd", "even"), ("private", "public"), ("import", "export"), ("tall", "short"), ("noisy", "quiet"),
]


def pivot_task_items() -> list[dict]:
    """Questions of :func:`task_items`' three kinds that it never asks (its
    training split): other capitals, the single-digit sums it leaves out and
    sums with a two-digit term, other opposites (174 items, shuffled)."""
    items = [{"prompt": f"What is the capital of {c}?", "answer": a} for c, a in TRAIN_CAPITALS]
    items += [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
              for a in range(1, 10) for b in range(1, 10) if (a * 7 + b * 3) % 9 >= 7]
    items += [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 20) for b in range(1, 10)
              if (a + b) % 2 == 0]
    items += [{"prompt": f"What is the opposite of {w}? Answer with one word.", "answer": o}
              for w, o in TRAIN_OPPOSITES]
    random.Random(5).shuffle(items)
    return items


def write_assets(out_dir) -> None:
    """Writes the real pair's evaluation files (``specjax/assets/chat``)."""
    import json
    import pathlib

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout_prompts.jsonl", "w") as f:
        for p in heldout_prompts():
            f.write(json.dumps({"prompt": p}) + "\n")
    with open(out / "task.jsonl", "w") as f:
        for item in task_items():
            f.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    import sys

    write_assets(sys.argv[1] if len(sys.argv) > 1 else "specjax/assets/chat")
