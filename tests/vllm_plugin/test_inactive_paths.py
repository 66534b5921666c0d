"""Where the plugin cannot act, it says so and refuses only what it cannot serve.

* The processed-logprobs wrap installs by the shape of what it patches, never by version
  string, each runner's on its own; where it cannot install, only designed requests under a
  processed mode on that runner are refused.
* Speculative decoding (vLLM then runs no logits processors): a request with ``qmc_method``
  is refused, the drop-in stays off, and plain requests are served.

Each case runs in a fresh Python process (the wrap is process-wide state) that builds
``vllm.LLM`` with its engine core and worker in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a faked vLLM is the one the engine runs.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

pytestmark = pytest.mark.vllm


def test_an_unknown_version_string_installs_and_nothing_is_wrapped_twice(run_script):
    result = run_script(
        """
        import json, vllm
        vllm.__version__ = "0.33.1rc1.dev7+local"
        from vllm.v1.sample.sampler import Sampler
        from qmc_sampler.vllm_plugin import hooks, logprobs
        original = Sampler.sample
        logprobs.install()
        wrapped = Sampler.sample
        logprobs._state["v1"] = (False, "")  # as a second plugin load in the same process would find it
        logprobs._tried.discard("v1")
        logprobs.install()
        hooks.register(); hooks.register()
        print(json.dumps({"installed": logprobs.installed(), "wrapped": wrapped is not original,
                          "twice": Sampler.sample is not wrapped, "inner": Sampler.sample.__wrapped__ is original}))
        """
    )
    assert result == {"installed": True, "wrapped": True, "twice": False, "inner": True}


_PROCESSED_RUN = """
        from vllm import LLM, SamplingParams
        from qmc_sampler.vllm_plugin import logprobs

        llm = LLM(model={model!r}, enforce_eager=True, dtype="float32", max_model_len=256,
                  logprobs_mode="processed_logprobs")
        prompt = [{{"prompt_token_ids": [1, 70, 122, 35]}}]
        plain = llm.generate(prompt, SamplingParams(n=4, max_tokens=3, temperature=1.5, logprobs=1), use_tqdm=False)
        values = [lp[t].logprob for c in plain[0].outputs for t, lp in zip(c.token_ids, c.logprobs)]
        try:
            out = llm.generate(prompt, SamplingParams(n=4, max_tokens=3, temperature=1.5, logprobs=1,
                                                      extra_args={{"qmc_method": "lattice"}}), use_tqdm=False)
            designed = [lp[t].logprob for c in out[0].outputs for t, lp in zip(c.token_ids, c.logprobs)]
            refused = ""
        except Exception as e:
            designed, refused = [], str(e)
        print(json.dumps({{"v1": logprobs.installed("v1"), "mrv2": logprobs.installed("mrv2"),
                          "v1_untouched": V1Sampler.sample is original_v1,
                          "plain_finite": all(math.isfinite(v) and v < 0 for v in values),
                          "designed_finite": bool(designed) and all(math.isfinite(v) and v < 0 for v in designed),
                          "refused": refused}}))
"""


def test_a_changed_v1_signature_patches_nothing_of_v1_and_only_designed_requests_are_refused(
    tiny_model_dir, run_script
):
    result = run_script(
        """
        import json, math
        from vllm.v1.sample import sampler as v1
        vllms_own = v1.Sampler.sample

        def sample(self, logits, sampling_metadata, logprobs_mode_override=None, new_argument=None):  # a future vLLM
            return vllms_own(self, logits, sampling_metadata, logprobs_mode_override)

        v1.Sampler.sample = original_v1 = sample
        V1Sampler = v1.Sampler
        """
        + _PROCESSED_RUN.format(model=tiny_model_dir)
    )
    assert not result["v1"] and result["v1_untouched"]  # checked before patching
    assert result["plain_finite"]  # a request without a design: vLLM's own processed logprobs
    assert "processed_logprobs" in result["refused"] and "new_argument" in result["refused"]


def test_a_changed_mrv2_signature_costs_only_the_mrv2_wrap(tiny_model_dir, run_script):
    result = run_script(
        """
        import json, math
        from vllm.v1.sample.sampler import Sampler as V1Sampler
        original_v1 = V1Sampler.sample
        try:
            from vllm.v1.worker.gpu.sample import sampler as v2

            def sample(self, logits, idx_mapping, *, return_logprobs=False, new_argument=None):  # a future vLLM
                raise AssertionError("never called on the CPU")

            v2.Sampler.sample = sample
        except ImportError:
            pass
        """
        + _PROCESSED_RUN.format(model=tiny_model_dir)
    )
    assert result["v1"] and not result["mrv2"] and not result["v1_untouched"]
    assert result["refused"] == "" and result["designed_finite"] and result["plain_finite"]


def test_speculative_decoding_refuses_a_design_and_keeps_the_drop_in_off(tiny_model_dir, run_script):
    result = run_script(
        f"""
        import json, os
        os.environ["QMC_SAMPLER"] = "lattice"
        from vllm import LLM, SamplingParams
        llm = LLM(model={tiny_model_dir!r}, enforce_eager=True, dtype="float32", max_model_len=256,
                  speculative_config={{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 1}})
        prompt = [{{"prompt_token_ids": [1, 70, 122, 35]}}]
        drop_in = llm.generate(prompt, SamplingParams(n=4, max_tokens=4, temperature=1.5), use_tqdm=False)
        try:
            llm.generate(prompt, SamplingParams(n=4, max_tokens=4, temperature=1.5,
                                                extra_args={{"qmc_method": "lattice"}}), use_tqdm=False)
            refused = ""
        except Exception as e:
            refused = str(e)
        print(json.dumps({{"served": len(drop_in[0].outputs), "refused": refused}}))
        """
    )
    assert result["served"] == 4
    assert "speculative decoding" in result["refused"] and "qmc_method" in result["refused"]
