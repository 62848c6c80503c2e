"""mtp_core.bench.eval_sets: the shipped model's eval directory read as the factory wrote it (families and
target sets in the factory's order, the first n records of a set are the factory's set of n, the general
text), and the bench's refusals where the shipped sets end."""
from __future__ import annotations

import pytest

from mtp_core.bench.dataset import task_requests
from mtp_core.bench.eval_sets import accuracy_records, eval_records, general_chunks, read_manifest
from mtp_factory.data import FAMILIES, TARGET_SETS, general_text
from mtp_factory.data import generate_eval_records as factory_records


def test_manifest_names_the_factorys_sets_in_order() -> None:
    sets = read_manifest()
    assert list(sets.families) == FAMILIES
    assert sets.target_sets == tuple(name for name, _, _ in TARGET_SETS)
    assert (sets.seed, sets.per_set) == (1234, 50)


@pytest.mark.parametrize("count", [1, 7, 50])
def test_first_records_are_the_factorys_set_of_that_size(count: int) -> None:
    for family in ("add", "reverse"):
        assert eval_records(family, count) == factory_records(family, count, 1234)
    name, family, digits = TARGET_SETS[0]
    assert eval_records(name, count) == factory_records(family, count, 1234, digits, name)


def test_accuracy_records_are_every_family_then_every_target_set() -> None:
    records = accuracy_records(2)
    assert [r["task"] for r in records] == [t for t in (*FAMILIES, "add_3digit") for _ in range(2)]


def test_general_chunks_are_the_training_mixs_text() -> None:
    if general_text.fingerprint() != read_manifest().general_text:
        pytest.skip("this Python's standard library is not the one the shipped general text was read from")
    assert general_chunks() == general_text.load_chunks()


def test_refusals_where_the_shipped_sets_end() -> None:
    with pytest.raises(ValueError, match="unknown eval set 'division'"):
        eval_records("division", 1)
    for count in (0, 51):
        with pytest.raises(ValueError, match="between 1 and 50"):
            eval_records("add", count)
    with pytest.raises(ValueError, match="--num_requests 450 or fewer"):
        task_requests("all", 451, 8)
    with pytest.raises(ValueError, match="--num_requests 50 or fewer"):
        task_requests("mul", 51, 8)
    with pytest.raises(ValueError, match="--seed 7: the held-out task prompts ship with the model"):
        task_requests("all", 9, 8, seed=7)
    assert len(task_requests("all", 450, 8)) == 450
    assert len(task_requests("general", 3, 8, seed=7)) == 3          # --seed still picks the text sample
