"""The public reference loop and its argument checks."""

import pytest
import torch

import qmc_sampler
from qmc_sampler import METHODS, GroupSpec, sample_group


def test_methods_lists_the_designs():
    assert set(METHODS) == {"iid", "lattice", "stratified", "arithmetic", "sobol", "antithetic"}
    assert qmc_sampler.METHODS is METHODS


def test_returns_n_sequences_of_at_most_max_tokens(toy_model):
    seqs = sample_group(toy_model.next_logits, GroupSpec("lattice", 5, 0), max_tokens=3)
    assert len(seqs) == 5 and all(len(s) == 3 for s in seqs)
    assert sample_group(toy_model.next_logits, GroupSpec("lattice", 5, 0), max_tokens=0) == [[]] * 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, r"temperature=0.0 must be a finite number >= 1e-05; temperature 0 is greedy"),
        ({"temperature": float("nan")}, r"temperature=nan must be a finite number"),
        ({"top_k": -2}, r"top_k=-2 must be an int >= 1, or 0 / -1 to disable it"),
        ({"top_k": 2.5}, r"top_k=2.5 must be an int"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\]"),
    ],
)
def test_invalid_sampling_parameters_are_named(toy_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_group(toy_model.next_logits, GroupSpec("iid", 2, 0), 2, **kwargs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("lattic", 4, 0), r"method='lattic' is not a design; use one of"),
        (("lattice", -1, 0), r"n=-1 is not a group size; use an int between 1 and 4294967296 \(or 0 for an"),
        (("lattice", 2**32 + 1, 0), r"n=4294967297 is not a group size; use an int between 1 and 4294967296"),
        (("stratified", 0, 0), r"method='stratified' needs its group size; extensible groups \(n=0\) take one of"),
        (("lattice", 2.0, 0), r"n=2.0 is not a group size"),
        (("lattice", 4, "7"), r"seed='7' is not a seed; use an int between -9223372036854775808 and 1844674"),
        (("lattice", 4, 2**64), r"seed=18446744073709551616 is not a seed; use an int between"),
        (("lattice", 4, -(2**63) - 1), r"seed=-9223372036854775809 is not a seed"),
        (("lattice", 4, 0, "alpha"), r"order='alpha' is not a vocabulary order; use one of"),
    ],
)
def test_invalid_group_specs_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        GroupSpec(*args)


def test_max_tokens_is_checked(toy_model):
    with pytest.raises(ValueError, match=r"max_tokens=-1 must be an int >= 0"):
        sample_group(toy_model.next_logits, GroupSpec("iid", 2, 0), -1)


def test_nan_logits_from_the_model_are_rejected():
    def nan_model(prefixes):
        return torch.full((len(prefixes), 4), float("nan"))

    with pytest.raises(ValueError, match="NaN or no admissible token"):
        sample_group(nan_model, GroupSpec("lattice", 2, 0), 2)


def test_wrong_logits_shape_is_rejected():
    with pytest.raises(ValueError, match=r"next_logits returned shape \(1, 4\); expected \[2, vocab\]"):
        sample_group(lambda prefixes: torch.zeros(1, 4), GroupSpec("iid", 2, 0), 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_works_on_the_device_of_the_logits(toy_model):
    seqs_cpu = sample_group(toy_model.next_logits, GroupSpec("lattice", 8, 3), 3)
    seqs_gpu = sample_group(lambda p: toy_model.next_logits(p).cuda(), GroupSpec("lattice", 8, 3), 3)
    assert seqs_cpu == seqs_gpu
