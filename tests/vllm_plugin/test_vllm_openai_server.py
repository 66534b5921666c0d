"""The plugin behind vLLM's own OpenAI server, driven by the official ``openai`` client and by
lm-evaluation-harness.

The server is started exactly as the README's recipe says, with the drop-in
switch ``QMC_SAMPLER=lattice`` (``--logits-processors`` is optional: the installed
entry point already loads the processor). First-token probabilities for the
balance checks come from transformers on the same weights, at temperature 1.5.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve, tmp_path_factory):
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
               "--max-model-len", "256",
               "--logits-processors", "qmc_sampler.vllm_plugin:QMCLogitsProcessor"]  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "QMC_SAMPLER": "lattice"}
    with serve(command, tmp_path_factory.mktemp("vllm-server") / "server.log", env) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    ("xargs", "key"),
    [
        ({"qmc_method": "lattic"}, "qmc_method"),
        ({"qmc_method": "lattice", "qmc_order": "x"}, "qmc_order"),
        ({"qmc_method": "lattice", "qmc_seed": "abc"}, "qmc_seed"),
        ({"qmc_methd": "lattice"}, "qmc_methd"),
    ],
)
def test_bad_vllm_xargs_get_http_400_naming_the_key(server, xargs, key):
    with pytest.raises(openai.BadRequestError) as info:
        server.completions.create(
            model="tiny", prompt="the quick brown", n=2, max_tokens=2, extra_body={"vllm_xargs": xargs}
        )
    assert info.value.status_code == 400
    assert key in str(info.value)


def test_a_lattice_group_over_http(server):
    response, again = (
        server.completions.create(
            model="tiny",
            prompt="the quick brown",
            n=16,
            max_tokens=3,
            temperature=1.0,
            logprobs=1,
            extra_body={"vllm_xargs": {"qmc_method": "lattice", "qmc_seed": 4}},
        )
        for _ in range(2)
    )
    assert [c.text for c in response.choices] == [c.text for c in again.choices]
    first = [c.logprobs.tokens[0] for c in response.choices]
    # Balanced: each first token appears ⌊16q⌋ or ⌈16q⌉ times, q from the returned logprobs.
    for token in set(first):
        q = np.exp(response.choices[first.index(token)].logprobs.token_logprobs[0])
        assert first.count(token) in (np.floor(16 * q), np.ceil(16 * q)), (token, first.count(token), 16 * q)


T = 1.5


def first_token_probs(hf_model, prompt_ids):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, -1]
    return torch.softmax(logits.double() / T, -1).numpy()


def balanced(tokens, q):
    counts = np.bincount(tokens, minlength=len(q))
    return bool(np.all((counts == np.floor(len(tokens) * q)) | (counts == np.ceil(len(tokens) * q))))


def test_64_separate_n1_requests_over_http_form_one_group(server, hf_model):
    # Sent in 8 waves of 8 concurrent requests: the first 8·w arrivals are waves 1..w.
    prompt = [1, 70, 122, 35]

    def one(_):
        out = server.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, temperature=T, extra_body={"return_token_ids": True}
        )
        return out.choices[0].token_ids[0]

    first = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(8):
            first += list(pool.map(one, range(8)))
    q = first_token_probs(hf_model, prompt)
    for m in (8, 16, 32, 64):
        assert balanced(first[:m], q), (m, first[:m])


def test_one_seed_on_every_request_over_http_gives_distinct_balanced_samples(server, hf_model):
    prompt = [1, 90, 12]
    outs = [
        server.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=T, seed=1234, extra_body={"return_token_ids": True}
        ).choices[0]
        for _ in range(16)  # one after another, like lm-eval with num_concurrent=1
    ]
    assert len({tuple(o.token_ids) for o in outs}) > 4
    assert balanced([o.token_ids[0] for o in outs], first_token_probs(hf_model, prompt))


LM_EVAL_TASK = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
repeats: 16
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 1
  do_sample: true
  temperature: 1.5
{extra}metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def run_lm_eval(base_url, tmp_path, name, extra=""):
    """lm-evaluation-harness's own CLI against the server; returns each doc's repeats."""
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"prompt": "the quick brown", "answer": "fox"}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.yaml").write_text(LM_EVAL_TASK.format(name=name, data=data, extra=extra))
    out = tmp_path / f"out-{name}"
    model_args = f"model=tiny,base_url={base_url}/completions,tokenizer_backend=none,tokenized_requests=False"
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", name,
         "--include_path", str(tasks), "--log_samples", "--output_path", str(out)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{name}_*.jsonl")
    return [json.loads(line)["resps"][0] for line in samples.read_text().splitlines()]


def test_lm_eval_repeats_come_back_as_one_balanced_group(server, hf_model, tiny_model_dir, tmp_path, capsys):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed")
    from transformers import AutoTokenizer

    base_url = str(server.base_url).rstrip("/")
    (grouped,) = run_lm_eval(base_url, tmp_path, "qmc_repeats")
    # The same task with the plugin off for its requests: plain vLLM with lm-eval's seed 1234 on all 16.
    (plain,) = run_lm_eval(base_url, tmp_path, "qmc_repeats_off", "  vllm_xargs: {qmc_auto_group: 0}\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    q = first_token_probs(hf_model, tokenizer.encode("the quick brown"))
    texts = {i: tokenizer.decode([i]) for i in np.flatnonzero(q > 1e-4)}
    unique = {i: t for i, t in texts.items() if list(texts.values()).count(t) == 1}
    counts = {t: grouped.count(t) for t in unique.values()}
    with capsys.disabled():
        print(f"\nlm-eval {lm_eval.__version__}, 16 repeats of one doc, seed 1234 on each:")
        print("  with the plugin:", {t: c for t, c in counts.items() if c}, "expected 16q:",
              {unique[i]: round(16 * q[i], 2) for i in unique if 16 * q[i] > 0.5})  # fmt: skip
        print("  plugin off:     ", {t: plain.count(t) for t in set(plain)})
    for i, text in unique.items():
        assert grouped.count(text) in (np.floor(16 * q[i]), np.ceil(16 * q[i])), (text, grouped.count(text), 16 * q[i])
    assert len(set(plain)) == 1  # without the plugin the 16 "samples" are one sample, 16 times
