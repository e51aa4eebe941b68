import numpy as np

from cmpchat.evaluation.agreement import near_ties, parting_is_explained


def test_a_near_tie_is_two_top_logits_within_twice_the_tolerance_of_the_largest():
    logits = np.array([[10.0, 9.9, 0.0], [10.0, 7.0, -1.0], [-20.0, 1.0, 0.5]])
    assert near_ties(logits, 1e-2).tolist() == [True, False, False]
    assert near_ties(logits, 1e-1).tolist() == [True, False, True]


def test_a_parting_is_explained_only_by_a_tie_at_or_before_it():
    clear, tie = [10.0, 5.0, 0.0], [10.0, 9.95, 0.0]
    logits = np.array([clear, clear, tie, clear])
    assert parting_is_explained(logits, 2) and parting_is_explained(logits, 3)
    assert not parting_is_explained(logits, 1)
