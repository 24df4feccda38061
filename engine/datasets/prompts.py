"""Prompt sets by task (code, math, chat, summarization).

- `BENCH`: a few prompts that benchmarks and the greedy-equality tests run on.
- `heldout()`: prompts never trained on (engine/data/heldout_prompts.json), for evaluating drafts
  and controllers.
- `training_prompts()`: thousands of prompts built from the templates below with a seeded RNG,
  for distillation; held-out prompts are removed from them.
- `stdlib_texts()`: text that is on every machine (the Python docs' topics and module
  docstrings), for summarization prompts and plain-text distillation."""
from __future__ import annotations

import json
import random
import re
from functools import lru_cache

from engine.base.names import DATA_DIR

TASKS = ("code", "math", "chat", "summarization")
# The prompt a newcomer meets (Live decode, Compare, bench browser): one the embedded draft knows
# well (code), so the default run shows where drafting pays and the cost-aware policy when not.
WORKBENCH_PROMPT = "Write a Python function that checks whether a number is prime."
HELDOUT_FILE = DATA_DIR / "heldout_prompts.json"

BENCH: dict[str, list[str]] = {
    "code": [
        "Write a Python function that checks whether a number is prime.",
        "Write a JavaScript function that removes duplicate values from an array.",
    ],
    "math": [
        "What is 17 * 23? Explain step by step.",
        "A train travels 120 km in 1.5 hours. What is its average speed in km/h?",
    ],
    "chat": [
        "Hi! Can you suggest three fun things to do on a rainy weekend?",
        "What is the difference between a virus and a bacterium?",
    ],
    "summarization": [
        "Summarize in two sentences: The mitochondrion is an organelle found in most cells. It "
        "produces most of the cell's supply of ATP through cellular respiration, and it also plays "
        "a role in signalling, cell differentiation and cell death.",
        "Summarize briefly: Python is a high-level programming language. Its design philosophy "
        "emphasizes code readability with significant indentation. It supports several "
        "programming paradigms, including structured, object-oriented and functional programming.",
    ],
}


def bench_prompts(per_task: int = 1) -> list[tuple[str, str]]:
    """(task, prompt) pairs, `per_task` from each task, tasks interleaved."""
    return [(task, ps[i]) for i in range(per_task) for task, ps in BENCH.items() if i < len(ps)]


def first_per_task(prompts: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """The first n of each task's (task, prompt) pairs, in the list's order."""
    seen: dict[str, int] = {}
    out = []
    for task, p in prompts:
        if seen.get(task, 0) < n:
            out.append((task, p))
            seen[task] = seen.get(task, 0) + 1
    return out


@lru_cache(maxsize=1)
def _heldout() -> dict[str, list[str]]:
    data = json.loads(HELDOUT_FILE.read_text())
    return {task: data[task] for task in TASKS}


def heldout(per_task: int | None = None) -> list[tuple[str, str]]:
    """(task, prompt) pairs, tasks interleaved: the held-out file's (10 a task), then, for a
    `per_task` beyond them, real prompts never trained on (`real_heldout`)."""
    data = _heldout()
    n = per_task or max(len(v) for v in data.values())
    if n > min(len(v) for v in data.values()):
        real = real_heldout(n)
        data = {t: data[t] + [p for p in real[t] if p not in data[t]] for t in TASKS}
    return [(t, data[t][i]) for i in range(n) for t in TASKS if i < len(data[t])]


# The EAGLE head's ShareGPT sample is drawn from the first 3 × 600 conversations of two turns or
# more (training/eagle_distill.py); real held-out prompts come from past them.
SHAREGPT_TRAINED = 1800
_CODE_WORDS = re.compile(r"```|\bdef |\bfunction\b|\bcode\b|\bscript\b|\bclass\b|\bSQL\b|\bpython\b", re.I)
_MATH_WORDS = re.compile(r"^(?!.*(https?:|www\.)).*(\b\d+(\.\d+)?\s?[+*×^=]\s?\d+(\.\d+)?\b(?![-/.]\d)|"
                         r"\b(solve|calculate|compute|integral|derivative|how (much|many))\b.*\d)", re.I | re.S)
_SUMMARY_WORDS = re.compile(r"\bsummar(y|ise|ize|ization)\b|\btl;?dr\b", re.I)
REAL_CHARS = {"code": (0, 1500), "math": (20, 400), "chat": (20, 400), "summarization": (200, 1500)}


@lru_cache(maxsize=4)
def real_heldout(per_task: int) -> dict[str, list[str]]:
    """Up to `per_task` real prompts a task that nothing in the repository trains on: HumanEval's
    problems (code), and the opening user turns of ShareGPT V3 conversations past the EAGLE
    head's sample, sorted by a keyword rule into math, summarization and chat (plain ASCII
    prose, lengths in REAL_CHARS), in the data's order."""
    from engine.datasets.humaneval import problems
    from engine.datasets.sharegpt import conversations

    out: dict[str, list[str]] = {t: [] for t in TASKS}
    out["code"] = [f"Complete this Python function.\n\n{p['prompt'].strip()}" for p in problems()[:per_task]]
    for i, msgs in enumerate(conversations(min_turns=2)):
        if all(len(v) >= per_task for v in out.values()):
            break
        text = msgs[0]["content"].strip()
        if i < SHAREGPT_TRAINED or not text.isascii() or _CODE_WORDS.search(text):
            continue
        task = "summarization" if _SUMMARY_WORDS.search(text) else "math" if _MATH_WORDS.search(text) else "chat"
        lo, hi = REAL_CHARS[task]
        if lo <= len(text) <= hi and len(out[task]) < per_task and text not in out[task]:
            out[task].append(text)
    return out


@lru_cache(maxsize=4)
def real_training(n: int) -> tuple[str, ...]:
    """Up to `n` real requests to train on: the opening user turns of ShareGPT V3 conversations
    from the EAGLE head's sample (before SHAREGPT_TRAINED; `real_heldout` draws from past it, so
    the two never meet), plain ASCII, 20 to 1,500 characters, in the data's order."""
    from engine.datasets.sharegpt import conversations

    out: list[str] = []
    for i, msgs in enumerate(conversations(min_turns=2)):
        text = msgs[0]["content"].strip()
        if i >= SHAREGPT_TRAINED or len(out) == n:
            break
        if text.isascii() and 20 <= len(text) <= 1500 and text not in out:
            out.append(text)
    return tuple(out)


# -- templates for training prompts ------------------------------------------------------------
_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby", "bash"]
_CODE_TASKS = [
    "reverses a string", "counts the vowels in a string", "finds the maximum of a list of numbers",
    "computes the factorial of n", "checks whether a year is a leap year", "sorts a list of words by length",
    "removes whitespace from both ends of a string", "converts Celsius to Fahrenheit",
    "returns the second largest number in a list", "flattens a nested list", "counts word frequencies in a text",
    "checks whether two strings are anagrams", "computes the greatest common divisor of two numbers",
    "validates an email address with a simple rule", "parses a date string in YYYY-MM-DD format",
    "reads a text file and returns its lines", "writes a list of rows to a CSV file",
    "implements binary search on a sorted list", "implements bubble sort", "implements a queue with two stacks",
    "generates all permutations of a list", "returns the prime numbers below n", "capitalizes every word in a sentence",
    "computes the average of a list, ignoring None values", "chunks a list into pieces of size n",
    "merges two dictionaries", "finds the most common element in a list", "checks whether brackets are balanced",
    "converts a number to Roman numerals", "computes the running total of a list", "transposes a matrix",
    "removes duplicates from a list while keeping the order", "converts a string to snake_case",
    "finds the longest word in a sentence", "counts the set bits of an integer", "rotates a list by k positions",
    "retries a function call up to three times", "measures how long a function takes to run",
    "returns the n most frequent words in a file", "checks whether a number is a perfect square",
    
    "counts the lines of a file", "downloads a web page and prints its title", "shuffles a list in place",
    "groups a list of records by a key", "computes the median of a list", "checks whether a list is sorted",
    "converts a binary string to an integer", "finds all pairs in a list that add up to a target",
    "implements a simple linked list", "parses a JSON string",
    "sums the digits of a number", "finds the intersection of two lists", "computes compound interest",
    "generates a random password", "returns the index of the first repeated character",
    "validates a phone number", "computes the distance between two points", "converts a dictionary to JSON",
    "finds the missing number in a sequence from 1 to n",
    "checks whether a number is even or odd", "prints a multiplication table", "computes the power set of a set",
    "memoizes a function", "throttles a function", "sorts a list of tuples by the second item",
    "counts how often each character appears",
    "converts a list of strings to uppercase", "deep-copies a nested dictionary", "reverses the words in a sentence",
]
_CODE_FORMS = [
    "Write a {lang} function that {task}.", "Can you write {lang} code that {task}?",
    "I need a {lang} function that {task}. Please include a short example.",
    "Implement a function in {lang} that {task}.", "Show me how to write a {lang} function that {task}.",
    "In {lang}, write code that {task}, and explain it briefly.", "Write a short {lang} program that {task}.",
    "How would you write a function in {lang} that {task}?",
]
_CODE_EXPLAIN = [
    "What does the Python built-in function {name} do? Give an example.",
    "Explain the difference between a list and a tuple in Python.",
    "What is a {concept} in programming? Give a short example.",
    "When should I use a {concept}?",
    "Explain {concept} in simple terms.",
    "What is the difference between a {concept} and a {concept2}?", "How do I debug a {concept}?",
    "Write a SQL query that {sql}.", "What are the pros and cons of using a {concept}?",
    "Give an example of a {concept} in {lang}.",
]
_SQL = [
    "selects all users older than 30", "counts the orders per customer", "finds the ten most expensive products",
    "joins the orders and customers tables", "deletes rows with a NULL email", "finds duplicate email addresses",
    "computes the average salary per department", "lists the customers who have never placed an order",
    "updates the price of a product", "returns the total sales per month",
]
_CONCEPTS = [
    "hash map", "linked list", "recursion", "closure", "generator", "decorator", "class", "interface",
    "binary tree", "queue", "stack", "regular expression", "unit test", "race condition", "mutex",
    "REST API", "JSON file", "database index", "memory leak", "pointer", "lambda function", "iterator",
    "exception", "context manager", "virtual environment", "git branch", "pull request", "cache",
]
_BUILTINS = ["zip", "enumerate", "map", "filter", "sorted", "any", "all", "range", "isinstance", "getattr",
             "reversed", "sum", "min", "max", "round", "open", "len", "print", "input", "dict"]

_CHAT_TOPICS = [
    "volcanoes", "black holes", "the water cycle", "the Roman Empire", "electric cars", "meditation",
    "photosynthesis", "the internet", "vaccines", "earthquakes", "coffee", "the Olympic Games",
    "the human heart", "rainbows", "solar panels", "dinosaurs", "the stock market", "recycling",
    "the moon", "bees", "tea", "chess", "jazz music", "the printing press", "glaciers", "democracy",
    "artificial intelligence", "the immune system", "tides", "inflation", "gravity", "the ozone layer",
    "hurricanes", "the Sahara desert",
    "the Amazon rainforest", "the pyramids of Egypt", "whales", "penguins", "honey", "chocolate", "bread",
    "the Great Wall of China", "Mars", "the Sun", "comets", "DNA", "antibiotics", "the brain", "muscles",
    "vitamins", "electricity", "magnets", "light", "sound", "rain", "snow", "wind energy", "nuclear power",
    "the French Revolution", "ancient Greece", "the Renaissance", "Shakespeare", "classical music", "painting",
    "the piano", "football", "basketball", "yoga", "running", "friendship", "happiness", "money", "banks",
    "taxes", "cryptocurrency", "smartphones", "social media", "email", "video games", "robots", "airplanes",
    "trains", "bicycles", "oceans", "rivers", "mountains", "forests", "cats", "dogs", "horses", "butterflies",
]
_CHAT_ACTIVITIES = [
    "learning to cook", "running a first marathon", "saving money", "studying for exams", "starting a garden",
    "learning to play guitar", "traveling on a budget", "public speaking", "keeping a journal",
    "making new friends in a new city", "staying healthy in winter", "reading more books", "learning to draw",
    "writing a cover letter", "preparing for a job interview", "taking better photos", "reducing stress",
    "organizing a small party", "training a puppy", "learning to swim", "moving to a new apartment",
    "eating healthier", "waking up early", "managing my time", "learning to code", "baking bread",
    "writing a novel", "planning a wedding", "buying a used car", "negotiating a salary", "living with roommates",
    "caring for houseplants", "camping with kids", "learning to meditate", "running a small business",
    "decluttering my home", "studying math", "dealing with a difficult coworker", "writing a thank-you note",
]
_CHAT_FORMS = [
    "What is {topic}?", "Tell me something interesting about {topic}.", "Explain {topic} to a ten-year-old.",
    "Why is {topic} important?", "Give me three facts about {topic}.", "How does {topic} work?",
    "What is the history of {topic}?", "Write a short paragraph about {topic}.",
    
    "What is the difference between {topic} and {topic2}?", "Write a short poem about {topic}.",
    "What do most people get wrong about {topic}?",
]
_CHAT_ADVICE = [
    "Give me three tips for {activity}.", "How do I get started with {activity}?",
    "What are common mistakes when {activity}?", "I want to try {activity}. Any advice?",
    "What should I know before {activity}?", "Can you make a simple plan for {activity}?",
    "How can I stay motivated when {activity}?",
]
_CHAT_SMALL = [
    "Hi! How are you today?", "Can you tell me a joke?", "What is your favorite color?",
    "Write a short poem about the sea.", "Write a haiku about autumn.", "Suggest a name for a pet turtle.",
    "What should I cook for dinner tonight?", "Write a friendly birthday message for a coworker.",
    "Thank you for your help!", "Write a two-line motivational quote.",
    "Write a short story about a lost key.", "Tell me a riddle.",
    "What is a good way to start a conversation?", "Write an email asking my manager for a day off.",
    "Recommend a few movies for a family evening.",
    "How do I apologize to a friend?", "Write a limerick about a cat.", "What are some healthy snacks?",
    "Plan a one-day trip to Paris.", "Describe a sunset in three sentences.", "How do I make a good cup of tea?",
]

# Round 1 and later (`distill --data-rounds 2`): more everyday request forms, written after v1's
# held-out agreement showed chat (0.40) and summarization (0.35) far behind code and math. Slot
# values close to a held-out prompt (sleep, novels, declining a meeting, weather vs climate,
# pancakes, the sky, hiking, working from home, second languages, octopuses) are left out.
_CHAT_WIDE: dict[str, tuple[list[str], list[str]]] = {
    "howto": (["How do I {x}?", "What is the best way to {x}?", "Can you explain how to {x}?",
               "What are some tips to {x}?", "I want to {x}. Where do I start?"],
              ["write a good resume", "clean a cast iron pan", "change a flat tire", "make a monthly budget",
               "remember people's names", "ask for feedback at work", "unclog a kitchen sink", "choose a laptop",
               "learn to touch type", "back up my computer", "stop procrastinating", "plan a vegetable garden",
               "pick a ripe watermelon", "brew coffee with a French press", "write a toast for a wedding",
               "organize my email inbox", "memorize a speech", "get rid of hiccups", "keep a conversation going",
               "reduce my screen time", "fold a paper airplane", "keep fresh herbs longer", "wash a wool sweater",
               "comfort a friend who is sad", "teach a child to ride a bike", "save energy at home",
               "prepare for a driving test", "write a short story", "take care of a goldfish", "paint a room",
               "choose running shoes", "make a podcast", "learn chess openings", "grow tomatoes on a balcony"]),
    "recipe": (["Give me a simple recipe for {x}.", "How do I make {x}?", "What ingredients do I need for {x}?",
                "What is an easy way to cook {x}?"],
               ["tomato soup", "guacamole", "banana bread", "fried rice", "a Greek salad", "scrambled eggs",
                "lemonade", "hummus", "chocolate chip cookies", "vegetable curry", "spaghetti carbonara",
                "a fruit smoothie", "mashed potatoes", "chicken noodle soup", "oatmeal", "a grilled cheese sandwich",
                "apple pie", "pesto", "roasted vegetables", "lentil soup", "brownies", "tacos", "a quiche",
                "iced tea", "garlic bread", "an omelette", "rice pudding", "a stir fry", "potato salad"]),
    "recommend": (["Can you recommend a few {x}?", "What are some good {x}?", "Suggest five {x}.",
                   "I am looking for {x}. Any ideas?"],
                  ["board games for a family evening", "podcasts about history", "science fiction films",
                   "documentaries about nature", "houseplants that are hard to kill", "hobbies for a quiet person",
                   "exercises I can do at my desk", "gifts for a coworker", "children's books about animals",
                   "strategy games for two players", "weekend trips from London", "easy instruments to learn",
                   "poems to read aloud", "songs for a road trip", "apps to learn drawing",
                   "activities for a group of friends", "snacks for a long train ride", "names for a bakery"]),
    "prepare": (["What should I pack for {x}?", "How should I prepare for {x}?", "Make a checklist for {x}."],
                ["a beach holiday", "a business trip", "a ski weekend", "a long flight", "a trip to Japan",
                 "a road trip", "a music festival", "a city break in Rome", "a first day at university",
                 "a picnic", "a day at the zoo", "a job fair", "a move to another country", "a school trip"]),
    "polite": (["How do I politely {x}?", "What is a kind way to {x}?", "Write a short message to {x}."],
               ["ask a neighbour to turn down their music", "remind a friend that they owe me money",
                "turn down a job offer", "ask my boss for a raise", "end a long phone call", "leave a party early",
                "tell a coworker they made a mistake", "ask for a refund", "cancel plans with a friend",
                "introduce myself to new neighbours", "ask a teacher for an extension",
                "disagree with someone in a meeting", "thank a colleague for their help", "ask for directions"]),
    "compare": (["What is the difference between {x}?", "How are {x} different?", "Compare {x}."],
                ["a crocodile and an alligator", "a hurricane and a tornado", "a lake and a pond",
                 "a frog and a toad", "stocks and bonds", "a credit card and a debit card",
                 "baking soda and baking powder", "a comet and an asteroid", "a rabbit and a hare",
                 "speed and velocity", "a moth and a butterfly", "a cold and the flu", "a latte and a cappuccino",
                 "RAM and storage", "an ocean and a sea", "a democracy and a monarchy", "a city and a town",
                 "a poem and a song", "a bakery and a cafe", "a violin and a cello"]),
    "benefits": (["What are the benefits of {x}?", "Why is {x} good for you?", "Is {x} worth it?"],
                 ["drinking water", "walking every day", "reading to children", "playing an instrument",
                  "volunteering", "stretching", "keeping a budget", "cycling to work", "eating breakfast",
                  "spending time in nature", "owning a pet", "public libraries", "taking breaks at work",
                  "drinking green tea", "learning to swim", "gardening", "writing things down", "board games"]),
    "animal": (["Tell me a fun fact about {x}.", "What is special about {x}?", "Where do {x} live and what do they eat?",
                "Why are {x} interesting?"],
               ["giraffes", "dolphins", "owls", "koalas", "elephants", "sharks", "ants", "flamingos", "sloths",
                "kangaroos", "jellyfish", "hedgehogs", "parrots", "camels", "bats", "turtles", "frogs", "squirrels",
                "pandas", "wolves", "crows", "starfish", "seahorses", "zebras", "foxes", "otters", "eagles"]),
    "why": (["Why {x}?", "Can you explain why {x}?"],
            ["is the ocean salty", "is grass green", "is ice slippery", "do leaves change colour in autumn",
             "is it colder at the top of a mountain", "do cats purr", "do we yawn", "does bread go stale",
             "do onions make us cry", "do we have seasons", "does metal feel cold", "do birds migrate",
             "do we dream", "does the Moon have phases", "do stars twinkle", "does popcorn pop"]),
}
_CODE_WIDE = [
    ("How do I {x} in Python?", ["read a JSON file", "sort a dictionary by value", "make an HTTP request",
                                 "get the current date and time", "create a virtual environment", "handle exceptions",
                                 "write text to a file", "format a string with variables", "parse command line arguments",
                                 "loop over two lists at once", "remove an item from a list", "check if a key is in a dictionary",
                                 "convert a string to a number", "run a shell command", "copy a file",
                                 "list the files in a folder", "generate random numbers", "split a string into words"]),
    ("Write a {x}.", ["Python class for a bank account with deposit and withdraw methods",
                      "Python class for a queue with enqueue and dequeue methods", "Python class for a 2D point with a distance method",
                      "Python class for a to-do list with add and remove methods",
                      "Python class for a rectangle with area and perimeter methods", "JavaScript class for a simple timer",
                      "Java class for a student with a name and grades", "Python dataclass for a book",
                      "Go struct for a user with a method that prints a greeting", "TypeScript interface for a product"]),
    ("Explain what {x} is, with an example.", ["a Python dictionary comprehension", "a Python generator expression",
                                               "a JavaScript promise", "a SQL join", "a Python decorator", "a Rust enum",
                                               "a Python f-string", "the Python with statement", "a bash for loop",
                                               "an HTML form", "a CSS flexbox layout", "a Git merge conflict"]),
]


_SUMMARY_FORMS = [
    "Summarize in one sentence: {text}", "Summarize in two sentences: {text}", "Summarize briefly: {text}",
    "Give a short summary of the following text: {text}", "What is the main idea of this text? {text}",
    "Summarize this in a short paragraph: {text}", "TL;DR: {text}", "Summarize the key points as a list: {text}",
    "Explain this text in simple words: {text}",
]


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    forms = [
        lambda: f"What is {a} * {b}? Explain step by step.",
        lambda: f"What is {a * 10 + b} + {b * 7 + a}?",
        lambda: f"What is {a * c} divided by {c}?",
        lambda: f"What is {rng.choice([5, 10, 15, 20, 25, 30, 40, 50])}% of {a * 10}?",
        lambda: f"Solve for x: {c}x + {a} = {c * b + a}.",
        lambda: f"A car travels at {a} km/h for {c} hours. How far does it go?",
        lambda: f"A train travels {a * c} km in {c} hours. What is its average speed?",
        lambda: f"If {c} pencils cost ${c * 2}, how much do {a} pencils cost?",
        lambda: f"What is the area of a rectangle that is {a} m long and {b} m wide?",
        lambda: f"What is the perimeter of a square with sides of {a} cm?",
        lambda: f"Convert {a} kilometres to metres.",
        lambda: f"Convert {c} hours and {b % 60} minutes into minutes.",
        lambda: f"A shop sells a book for ${a}. It is discounted by {rng.choice([10, 20, 25, 50])}%. What is the new price?",
        lambda: f"Tom has {a} apples and gives {min(a, b) // 2} to a friend. How many does he have left?",
        lambda: f"What is the sum of the numbers from 1 to {a}?",
        lambda: f"Is {a * 2 + 1} a prime number? Explain.",
        lambda: f"What is {a} squared?",
        lambda: f"What is the average of {a}, {b} and {c}?",
        lambda: f"A recipe needs {c} eggs for {c * 2} people. How many eggs are needed for {c * 4} people?",
        lambda: f"Round {a}.{b} to the nearest whole number.",
    ]
    return rng.choice(forms)()


# Subjects of the held-out summaries: texts about them are never summarized in training.
HELDOUT_SUBJECTS = ("printing press", "gutenberg", "photosynthesis", "remote work", "barrier reef", "coral",
                    "exercise", "hash table", "apollo", "electric car", "honeybee", "bees", "version control", "git")


def prose_paragraphs(answers: list[str], max_chars: int = 1200) -> list[str]:
    """Paragraphs of plain prose from model answers (no code, no lists, no held-out subject)."""
    out = []
    for answer in answers:
        for para in answer.split("\n\n"):
            para = " ".join(para.split())
            low = para.lower()
            if (200 <= len(para) <= max_chars and para[0].isalpha() and "`" not in para and "#" not in para
                    and not any(s in low for s in HELDOUT_SUBJECTS)):
                out.append(para)
    return out


@lru_cache(maxsize=1)
def stdlib_texts(max_chars: int = 1200) -> tuple[str, ...]:
    """Paragraph-sized English texts from the Python documentation shipped with Python."""
    from pydoc_data.topics import topics

    texts: list[str] = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = " ".join(para.split())
            # Prose only: skip code, grammar rules and headings.
            if 200 <= len(para) <= max_chars and para[0].isalpha() and "::=" not in para and ">>>" not in para:
                texts.append(para)
    return tuple(texts)


def _wide(rng: random.Random, groups) -> str:
    forms, slots = rng.choice(list(groups))
    return rng.choice(forms if isinstance(forms, list) else [forms]).format(x=rng.choice(slots))


def training_prompts(n_per_task: int = 400, seed: int = 0, data_round: int = 0,
                     texts: list[str] | None = None, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Deterministic (task, prompt) pairs for distillation, disjoint from the held-out set and
    from `exclude`. Round 0 draws from the original templates (v1's data, reproducible); later
    rounds mix in the wider everyday forms half of the time and summarize `texts` (default: the
    Python docs; distill passes the target's own earlier answers, general prose like the held-out
    summaries)."""
    rng = random.Random(seed if data_round == 0 else seed * 1009 + data_round)
    banned = {p for _, p in heldout()} | set(exclude)
    texts = list(texts or stdlib_texts())
    makers = {
        "code": lambda: rng.choice(_CODE_FORMS).format(lang=rng.choice(_LANGS), task=rng.choice(_CODE_TASKS))
        if rng.random() < 0.75 else rng.choice(_CODE_EXPLAIN).format(
            name=rng.choice(_BUILTINS), concept=rng.choice(_CONCEPTS), concept2=rng.choice(_CONCEPTS),
            sql=rng.choice(_SQL), lang=rng.choice(_LANGS)),
        "math": lambda: _math_prompt(rng),
        "chat": lambda: rng.choice([
            lambda: rng.choice(_CHAT_FORMS).format(topic=rng.choice(_CHAT_TOPICS), topic2=rng.choice(_CHAT_TOPICS)),
            lambda: rng.choice(_CHAT_ADVICE).format(activity=rng.choice(_CHAT_ACTIVITIES)),
            lambda: rng.choice(_CHAT_SMALL),
        ])(),
        "summarization": lambda: rng.choice(_SUMMARY_FORMS).format(text=rng.choice(texts)),
    }
    if data_round > 0:
        old = dict(makers)
        makers["chat"] = lambda: _wide(rng, _CHAT_WIDE.values()) if rng.random() < 0.6 else old["chat"]()
        makers["code"] = lambda: _wide(rng, _CODE_WIDE) if rng.random() < 0.4 else old["code"]()
    out: list[tuple[str, str]] = []
    for task, make in makers.items():
        seen: set[str] = set()
        for _ in range(n_per_task * 20):  # templates repeat; stop once enough distinct ones exist
            if len(seen) == n_per_task:
                break
            p = make()
            if p not in banned:
                seen.add(p)
        out += [(task, p) for p in sorted(seen)]
    rng.shuffle(out)
    return out
