"""Training and evaluation data of the shipped model: task traces (`tasks` and the family modules), the
training stream (`dataset`), the held-out sets written beside the model (`eval_sets`)."""
from mtp_factory.data.dataset import (
    FAMILIES, Example, describe_data, estimate_predictability, example_for, sample_example, training_texts,
)
from mtp_factory.data.eval_sets import TARGET_SETS, generate_eval_records, write_eval_sets, write_shipped_eval

__all__ = [
    "FAMILIES", "TARGET_SETS", "Example", "describe_data", "estimate_predictability", "example_for",
    "generate_eval_records", "sample_example", "training_texts", "write_eval_sets", "write_shipped_eval",
]
