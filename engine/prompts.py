"""Prompt sets by task. `BENCH` is what benchmarks and the greedy-equality tests run on; later
issues add the training and held-out sets beside it."""
from __future__ import annotations

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
