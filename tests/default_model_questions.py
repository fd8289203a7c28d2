"""The questions the default model's sampling defaults are held to: short factual questions with a
keyword a right answer contains, and open prompts whose answers must not loop."""

from __future__ import annotations

import re

# (question, accepted keywords: the answer is right when it contains one, case-insensitive). Facts
# SmolLM2-135M-Instruct knows: it answers them right at temperature 0.2 (asked which planet is the
# largest it says Neptune, whatever the sampling: that measures the model, not its sampling).
FACTUAL_QUESTIONS = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of England?", ("london",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("What is the opposite of hot?", ("cold",)),
    ("What is 2 plus 2?", ("4", "four")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
]

OPEN_PROMPTS = [
    "Tell me a story about a dragon.",
    "Write a short poem about the sea.",
    "Explain how a computer works.",
    "Describe your favorite food.",
    "What should I do on a rainy day?",
]

LOOP_SPAN = 8  # tokens
LOOP_REPEATS = 3


def is_right(answer: str, keywords: tuple[str, ...]) -> bool:
    text = answer.lower()
    return any(re.search(rf"(?<![a-z0-9]){re.escape(k)}(?![a-z0-9])", text) for k in keywords)


def has_loop(token_ids: list[int], span: int = LOOP_SPAN, repeats: int = LOOP_REPEATS) -> bool:
    """Whether some `span`-token run occurs `repeats` times (overlaps allowed) in `token_ids`."""
    counts: dict[tuple[int, ...], int] = {}
    for start in range(len(token_ids) - span + 1):
        window = tuple(token_ids[start:start + span])
        counts[window] = counts.get(window, 0) + 1
        if counts[window] >= repeats:
            return True
    return False
