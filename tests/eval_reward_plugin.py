"""A custom reward for the evaluation tests: 1.0 when the completion says "yes", else 0.0,
whatever the reference answer (a verifier GSM8K scoring would disagree with)."""


def says_yes(completion: str, answer: str) -> float:
    return 1.0 if "yes" in completion.split() else 0.0


def always(completion: str, answer: str) -> float:
    return 1.0
