"""The request contract: every ``qmc_*`` key is checked, bounds included, with the key and its allowed values named."""

import pytest

from qmc_sampler.limits import MAX_GROUP_SIZE, SEED_MAX
from qmc_sampler.members.keys import KEYS, check_extra_args

REFUSED = [
    ({"qmc_metod": "lattice"}, "unknown extra_args/vllm_xargs key 'qmc_metod'"),
    ({"qmc_method": "-probe-"}, "'qmc_method'='-probe-' is not a design"),
    ({"qmc_order": "random"}, "'qmc_order'='random' is not a vocabulary order"),
    ({"qmc_seed": SEED_MAX + 1}, "'qmc_seed'"),
    ({"qmc_group": "", "qmc_n": 2}, "'qmc_group' is a string of 0 characters"),
    ({"qmc_group": 1.5, "qmc_n": 2}, "'qmc_group'=1.5 must be a string"),
    ({"qmc_group": "g", "qmc_n": MAX_GROUP_SIZE + 1}, "'qmc_n'"),
    ({"qmc_index": 0, "qmc_n": 2}, "'qmc_index' needs 'qmc_group' and 'qmc_n'"),
    ({"qmc_group": "g", "qmc_n": 2, "qmc_index": 2}, "'qmc_index'=2 must be < 'qmc_n'=2"),
    ({"qmc_group": "g"}, "'qmc_group' and 'qmc_n' go together"),
    ({"qmc_auto_group": 2}, "'qmc_auto_group'=2 must be 0 or 1"),
]


@pytest.mark.parametrize(("extra", "message"), REFUSED)
def test_a_bad_key_is_refused_naming_it(extra, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_extra_args(extra)


def test_a_full_request_and_keys_of_others_pass():
    check_extra_args({"qmc_method": "lattice", "qmc_seed": 7, "qmc_order": "sorted", "qmc_group": "g", "qmc_index": 3,
                      "qmc_n": 4, "qmc_auto_group": 0, "temperature_hint": 1})  # fmt: skip
    assert len(KEYS) == 7 and all(key.startswith("qmc_") for key in KEYS)
