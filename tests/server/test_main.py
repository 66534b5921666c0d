"""``qmc-serve``'s command line: a bad option is one line and exit code 2, before any model is touched."""

import os

import pytest

import qmc_sampler

pytest.importorskip("vllm", reason="vLLM not installed")

from qmc_sampler.server.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-n", "0"], "argument --max-n: 0 must be >= 1"),
        (["--max-members-in-flight", "many"], "argument --max-members-in-flight: 'many' is not an integer"),
        (["--sampler", "lattic"], "argument --sampler: invalid choice: 'lattic'"),
        (["--queue-timeout", "-1"], "argument --queue-timeout: -1 must be a finite number of seconds >= 0"),
        (["--queue-timeout", "nan"], "must be a finite number of seconds >= 0"),
        (["--kv-cache-gb", "0"], "argument --kv-cache-gb: 0 must be >= 1"),
        (["--dtype", "fp7"], "argument --dtype: invalid choice: 'fp7'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
        # vLLM's own checks, which used to run after the conversion (or not until the engine started):
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--chat-template", "/no/such/template.jinja"], "/no/such/template.jinja"),
        (["--headless", "--api-server-count", "2"], "--api-server-count=2 cannot be used with --headless"),
        (["--config", "/no/such/config.yaml"], "/no/such/config.yaml"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_code_2_with_nothing_converted(tmp_path, monkeypatch, capsys, argv, message):
    cache = tmp_path / "model-cache"  # as on a new machine: the default model not converted yet
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(cache))
    saved = dict(os.environ)  # qmc-serve sets vLLM's process-wide variables before parsing
    try:
        with pytest.raises(SystemExit) as info:
            main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("qmc-serve: error: ") and message in err, err
    assert not cache.exists(), sorted(cache.rglob("*"))


@pytest.mark.parametrize(("given", "taken"), [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_vllms_other_dtype_names_reach_the_cpu_defaults_as_their_own(given, taken):
    from qmc_sampler.server.main import _check_options, _parser

    from qmc_sampler.cpu_defaults import engine_dtype

    parser = _parser()
    args = parser.parse_args(["--dtype", given])
    _check_options(args, parser)
    assert args.dtype == taken and engine_dtype(args.dtype) == (taken, "as requested")  # was: refused after converting


def test_the_environment_opens_invocations_as_the_flag_does(monkeypatch):
    from qmc_sampler.server.main import OPEN_INVOCATIONS_ENV, _apply_defaults, _parser

    parser = _parser()
    args = parser.parse_args(["--model", "/some/model", "--invocations-without-key"])
    assert args.invocations_without_key
    args = parser.parse_args(["--model", "/some/model"])
    monkeypatch.setenv(OPEN_INVOCATIONS_ENV, "1")
    saved = dict(os.environ)
    try:
        _apply_defaults(args, parser)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert args.invocations_without_key


def test_version_names_the_distribution_its_release_and_the_vllm_under_it(capsys):
    import vllm
    from qmc_sampler.server.main import _parser

    with pytest.raises(SystemExit) as done:
        _parser().parse_args(["--version"])
    assert done.value.code == 0
    expected = f"qmc-serve (qmc-llm-sampler {qmc_sampler.__version__}) on vLLM {vllm.__version__}"
    assert capsys.readouterr().out.strip() == expected


def test_a_vllm_without_what_qmc_serve_needs_is_refused_at_start_in_one_line(monkeypatch, capsys):
    # vLLM 0.24-0.28's AsyncLLM cannot count its unfinished requests: /stats and the graceful shutdown
    # answered 500 there. qmc-serve says so before anything starts.
    from qmc_sampler.server.main import main
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.delattr(AsyncLLM, "get_num_unfinished_requests")
    with pytest.raises(SystemExit) as done:
        main(["--model", "/some/model"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "qmc-serve cannot run on vLLM" in err and "vllm serve" in err, err
