"""Training and evaluation data for the project's tiny reasoning model (see `dataset` for the API)."""
from mtp_core.data.dataset import (
    FAMILIES, Example, describe_data, estimate_predictability, example_for, load_eval_set, sample_example,
    training_texts, write_eval_sets,
)
from mtp_core.data.scoring import extract_answer, score

__all__ = [
    "FAMILIES", "Example", "describe_data", "estimate_predictability", "example_for", "extract_answer",
    "load_eval_set", "sample_example", "score", "training_texts", "write_eval_sets",
]
