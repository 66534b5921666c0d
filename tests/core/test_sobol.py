"""Sobol' points from scipy's shipped direction numbers."""

import numpy as np
from scipy.stats import qmc

from qmc_sampler.sobol import MAX_DIMENSION, direction_numbers, sobol_coordinates


def test_table_covers_scipys_21201_dimensions() -> None:
    assert direction_numbers().shape == (MAX_DIMENSION, 32)


def test_unscrambled_points_equal_scipys() -> None:
    d, n = 64, 256
    reference = qmc.Sobol(d, scramble=False).random(n)
    points = np.repeat(np.arange(n), d).reshape(n, d)
    dims = np.tile(np.arange(d), (n, 1))
    np.testing.assert_array_equal(sobol_coordinates(points, dims) / 2.0**32, reference)


def test_unscrambled_points_equal_scipys_in_the_last_dimensions() -> None:
    n = 32
    reference = qmc.Sobol(MAX_DIMENSION, scramble=False).random(n)[:, -3:]
    for j, dim in enumerate(range(MAX_DIMENSION - 3, MAX_DIMENSION)):
        ours = sobol_coordinates(np.arange(n), np.full(n, dim)) / 2.0**32
        np.testing.assert_array_equal(ours, reference[:, j])
