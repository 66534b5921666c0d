"""Fixtures of the evaluation tests."""

import pytest


@pytest.fixture
def interrupting():
    """``interrupting(logits, rounds)``: a :class:`HostBackend` that stops a run with KeyboardInterrupt
    after ``rounds`` rounds (the way a killed run stops), once."""
    from qmc_sampler.eval.runs.sequential import HostBackend

    class Interrupting(HostBackend):
        def __init__(self, logits, rounds: int) -> None:
            super().__init__(logits)
            self.left = rounds

        def run(self, jobs, on_group):
            if self.left == 0:
                raise KeyboardInterrupt
            self.left -= 1
            super().run(jobs, on_group)

    return Interrupting
