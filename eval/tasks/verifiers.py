"""Verifiers for your own problems: does a completion match the reference ``answer``?

Built in (``--task-option verifier=NAME``):

============== ===========================================================================
name           a completion is correct if …
============== ===========================================================================
answer_tag     the text of its last ``<answer>…</answer>`` equals the answer after
               normalisation (the default; no tag: ``no_answer``)
exact          the whole completion equals the answer after normalisation
numeric        its last number (in the last ``<answer>`` tag if there is one) equals the
               numeric answer (relative tolerance 1e-6; ``1,000`` and ``$5`` are read)
regex          the answer, a Python regular expression, matches somewhere in it
============== ===========================================================================

Normalisation: Unicode NFKC, lower case, whitespace collapsed, surrounding
whitespace and trailing ``.`` removed.

Your own: ``verifier=package.module:function``, or a name registered under the
entry-point group ``qmc_sampler.verifiers``. The function is called as
``function(completion, answer, problem)`` (``problem``: the JSONL line as a dict)
and returns a bool or a :class:`~qmc_sampler.eval.tasks.catalog.Verdict`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from qmc_sampler.eval.tasks.catalog import Verdict, extract_answer

__all__ = ["ENTRY_POINT_GROUP", "VERIFIERS", "Verifier", "load_verifier", "normalize", "numeric_answer"]

ENTRY_POINT_GROUP = "qmc_sampler.verifiers"
Verifier = Callable[[str, str, dict[str, Any]], "bool | Verdict"]
_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
#: A reference answer for ``numeric``: one number, whole (commas only between groups of three digits).
_ONE_NUMBER = re.compile(r"[-+]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def normalize(text: str) -> str:
    """NFKC, lower case, collapsed whitespace, no surrounding whitespace or trailing full stop."""
    text = unicodedata.normalize("NFKC", text).lower()
    return re.sub(r"\s+", " ", text).strip().rstrip(".").strip()


def answer_tag(completion: str, answer: str, problem: dict[str, Any]) -> Verdict:
    """The last ``<answer>`` tag, normalised, equals the normalised answer."""
    got = extract_answer(completion)
    if got is None:
        return Verdict.failed("no_answer")
    return Verdict.passed() if normalize(got) == normalize(answer) else Verdict.failed("wrong_answer")


def exact(completion: str, answer: str, problem: dict[str, Any]) -> Verdict:
    """The whole completion, normalised, equals the normalised answer."""
    return Verdict.passed() if normalize(completion) == normalize(answer) else Verdict.failed("wrong_answer")


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").replace("$", ""))
    except ValueError:
        return None


def numeric(completion: str, answer: str, problem: dict[str, Any]) -> Verdict:
    """The last number (inside the last ``<answer>`` tag if any) equals the answer, to 1e-6 relative."""
    tagged = extract_answer(completion)
    got = _number(tagged if tagged is not None else completion)
    if got is None:
        return Verdict.failed("no_answer")
    want = numeric_answer(answer)
    return Verdict.passed() if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else Verdict.failed("wrong_answer")


def numeric_answer(answer: str) -> float:
    """The reference number of an answer for :func:`numeric`: the answer is one finite number,
    whole (``42``, ``-3.5``, ``$1,024``, ``1e-07``; not ``.5``, ``3/4``, ``1,2`` or ``42 apples``).

    Raises:
        ValueError: the answer is not one finite number.
    """
    text = answer.strip()
    want = float(text.replace(",", "").replace("$", "")) if _ONE_NUMBER.fullmatch(text) else math.nan
    if not math.isfinite(want):
        raise ValueError(f"answer {answer!r} is not a number (verifier 'numeric')")
    return want


def regex(completion: str, answer: str, problem: dict[str, Any]) -> Verdict:
    """The answer, a regular expression, matches somewhere in the completion."""
    return Verdict.passed() if re.search(answer, completion) else Verdict.failed("wrong_answer")


VERIFIERS: dict[str, Verifier] = {"answer_tag": answer_tag, "exact": exact, "numeric": numeric, "regex": regex}


def load_verifier(name: str) -> Verifier:
    """A built-in verifier, an installed entry point, or ``module:function``.

    Raises:
        ValueError: naming the verifier and what was tried.
    """
    if name in VERIFIERS:
        return VERIFIERS[name]
    registered = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if name in registered:
        return registered[name].load()
    module, sep, attr = name.partition(":")
    if sep and module and attr:
        try:
            function = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"verifier={name!r} cannot be loaded: {e}") from None
        if callable(function):
            return function
    raise ValueError(
        f"verifier={name!r} is not a verifier; use one of {sorted(VERIFIERS)}, an entry point of "
        f"{ENTRY_POINT_GROUP!r} ({sorted(registered) or 'none installed'}), or module:function"
    )
