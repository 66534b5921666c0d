"""qmc-serve refuses the plugin's private ``_qmc*`` keys in a body's ``vllm_xargs`` (issue 50, item 5).

Before, ``{"vllm_xargs": {"_qmc_user_seed": 5}}`` seeded the group in the engine while the reply said
``sampler_seed: null``; now the body is answered 400 naming the key, before vLLM parses it.
"""

import math

import pytest
from qmc_sampler.server.fields import FieldError, plan_request


@pytest.mark.parametrize("value", [5, 2**70, -1, 0.5, math.nan, "x", [1, 2], True], ids=repr)
@pytest.mark.parametrize("key", ["_qmc_user_seed", "_qmc_prompt", "_qmc", "_qmc_seal"])
@pytest.mark.parametrize("chat", [False, True])
def test_a_private_key_in_vllm_xargs_is_a_400_naming_it(key, value, chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x", "n": 2}
    with pytest.raises(FieldError, match=rf"key '{key}' is qmc-sampler's own") as info:
        plan_request(body | {"vllm_xargs": {key: value}}, chat=chat, default_sampler="lattice", max_n=64)
    assert (info.value.status, info.value.param) == (400, "vllm_xargs")
