from pathlib import Path

import numpy as np

from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.evaluation.agreement import parting_is_explained, read_paths, within_rounding
from cmpchat.model.gguf_file import ModelFile


def test_two_choices_may_flip_only_within_twice_the_spread_of_the_read_paths():
    one = np.array([10.0, 9.7, 0.0, 9.0])
    other = one + np.array([0.0, 0.2, 0.1, -0.1])  # spread 0.2: choices within 0.4 may flip
    assert within_rounding([one, other], 0, 1)
    assert not within_rounding([one, other], 0, 3)  # 1.0 apart in one path, 1.2 in the other
    assert not within_rounding([one, one], 0, 1)  # paths that agree exactly explain no parting
    assert within_rounding([one, one], 0, 0)


def test_the_reference_backends_read_paths_agree_and_explain_no_clear_parting(tiny_model_path: Path):
    backend = ReferenceBackend(ModelFile(tiny_model_path))
    prompt = [3, 14, 15, 92, 65, 35]
    paths = read_paths(backend, prompt)
    assert len(paths) == 3
    scale = np.abs(paths[0]).max()
    assert all(np.abs(p - paths[0]).max() <= 1e-4 * scale for p in paths[1:])
    ranked = np.argsort(paths[0])
    best, worst = int(ranked[-1]), int(ranked[0])
    assert not parting_is_explained(backend, prompt, [best], [worst], 0)
    assert parting_is_explained(backend, prompt, [best], [best], 0)
    assert backend.held_sequences == 0
