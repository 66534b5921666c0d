"""The plan that governs a run (its settings and rule, from the committed markdown) and the verdict by its rule."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from qmc_sampler.eval.stats.paired import SIGN_FLIP_MOST

#: What the verdict may say, by the plan's rule (:func:`decide`).
VERDICTS = ("faster", "slower", "no difference", "inconclusive")
#: A plan's machine-read part: its one fenced block that opens with ```json.
_BLOCK = re.compile(r"^```json\s*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_RULE_KEYS = {"alpha": float, "margin": float, "threshold": float}


@dataclass(frozen=True)
class Plan:
    """A committed plan: the settings it fixes and its rule's numbers.

    Attributes:
        path: where it was read from, as given. sha256: of its bytes (a later edit is another plan).
        settings: the run identity it fixes (:func:`grpo.plan.identity`'s keys but ``plan``).
        alpha: the two-sided sign-flip test's level for the primary metric.
        margin: the held-out AUC difference (either sign) below which designs count as equivalent:
            "no difference" needs the whole interval of the mean difference inside (−margin, margin).
            It governs that verdict only: "faster" and "slower" need the test to reject, whatever
            the size of the difference.
        threshold: the held-out reward of the secondary steps-to-threshold metric.
    """

    path: str
    sha256: str
    settings: dict[str, Any]
    alpha: float
    margin: float
    threshold: float

    def rule(self) -> dict[str, Any]:
        """What the run's header records: enough to give the verdict from the JSONL alone."""
        return {
            "path": self.path,
            "sha256": self.sha256,
            "settings": self.settings,
            "alpha": self.alpha,
            "margin": self.margin,
            "threshold": self.threshold,
        }


def read_plan(path: str) -> Plan:
    """The plan in the markdown file ``path``: its one ```json block holds ``settings`` (the run's
    identity) and the rule's ``alpha``, ``margin`` and ``threshold``.

    Raises:
        ValueError: the file cannot be read, has no such block or more than one, or the block is not
            JSON with those keys (numbers: 0 < alpha < 1, margin > 0, 0 ≤ threshold ≤ 1), or its
            settings' seeds are too few for the test to reach alpha, or more than it can list (20).
    """
    try:
        raw = Path(path).read_bytes()
        text = raw.decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the plan ({e})") from None
    blocks = _BLOCK.findall(text)
    if len(blocks) != 1:
        raise ValueError(f"{path}: a plan holds exactly one ```json block (its settings and rule); found {len(blocks)}")
    try:
        block = json.loads(blocks[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: its ```json block is not JSON ({e})") from None
    if not isinstance(block, dict) or not isinstance(block.get("settings"), dict):
        raise ValueError(f'{path}: its ```json block must be an object with "settings" (an object)')
    numbers = {}
    for key, kind in _RULE_KEYS.items():
        value = block.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: the plan's {key!r} must be a number; got {value!r}")
        numbers[key] = kind(value)
    if not (0 < numbers["alpha"] < 1 and numbers["margin"] > 0 and 0 <= numbers["threshold"] <= 1):
        raise ValueError(f"{path}: the plan needs 0 < alpha < 1, margin > 0 and 0 <= threshold <= 1; got {numbers}")
    seeds = block["settings"].get("seeds")
    least = max(2, math.ceil(math.log2(2 / numbers["alpha"])))  # 2 / 2^n ≤ alpha: the least p-value reaches it
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not least <= seeds <= SIGN_FLIP_MOST:
        raise ValueError(
            f"{path}: the plan's settings need seeds {least} … {SIGN_FLIP_MOST} (with fewer the exact sign-flip test "
            f"cannot reach alpha {numbers['alpha']:g}; more it cannot list); got {seeds!r}"
        )
    return Plan(path, hashlib.sha256(raw).hexdigest(), block["settings"], **numbers)


def differing_settings(identity: dict[str, Any]) -> list[str]:
    """The settings in which a run's identity differs from its plan's (its ``plan`` entry's ``settings``).

    Returns:
        The differing keys, sorted (a key missing on either side differs); empty where they agree.
    """
    planned = identity["plan"]["settings"]
    ran = {k: v for k, v in identity.items() if k != "plan"}
    return sorted(k for k in set(planned) | set(ran) if planned.get(k, "<missing>") != ran.get(k, "<missing>"))


@dataclass(frozen=True)
class Decision:
    """The primary comparison of one design with iid and what the plan's rule calls it.

    Attributes:
        verdict: one of :data:`VERDICTS`. mean: the mean paired difference (design − iid).
        p: the exact two-sided sign-flip p-value. interval: the inverted sign-flip test's interval of
            the mean difference at 1 − alpha (``(-inf, inf)`` where too few seeds can reject nothing).
    """

    verdict: str
    mean: float
    p: float
    interval: tuple[float, float]


def decide(diffs: list[float], alpha: float, margin: float) -> Decision:
    """The plan's rule on the paired primary differences (design − iid, one per seed):

    * **faster**: the sign-flip test rejects no difference (p ≤ alpha) and the mean difference is > 0;
    * **slower**: it rejects and the mean is < 0;
    * **no difference**: it does not reject, and the interval of the mean difference (the inverted
      test at 1 − alpha) lies inside (−margin, margin): any real difference is smaller than the margin
      (an equivalence test at alpha/2 a side, so conservative at alpha);
    * **inconclusive**: neither (too few seeds or too much noise to tell).

    Args:
        diffs: at least 2 and at most 20 paired differences. alpha, margin: the plan's.

    Raises:
        ValueError: fewer than 2 or more than 20 differences.
    """
    from qmc_sampler.eval.stats.paired import sign_flip_interval, sign_flip_p

    d = np.asarray(diffs, dtype=np.float64)
    if not 2 <= len(d) <= SIGN_FLIP_MOST:
        raise ValueError(f"decide needs 2 … {SIGN_FLIP_MOST} paired differences; got {len(d)}")
    p = sign_flip_p(d)
    interval = sign_flip_interval(d, level=1 - alpha)
    mean = float(d.mean())
    if p <= alpha and mean != 0:
        verdict = "faster" if mean > 0 else "slower"
    elif -margin < interval[0] and interval[1] < margin:
        verdict = "no difference"
    else:
        verdict = "inconclusive"
    return Decision(verdict, mean, p, interval)


def rising_share(curve: dict[int, float]) -> float:
    """The share of a held-out curve's evaluation points after the first at which it is above the
    point before (the plan's "still rising over at least half of its evaluation points")."""
    xs = sorted(curve)
    ups = [curve[b] > curve[a] + 1e-12 for a, b in itertools.pairwise(xs)]
    return float(np.mean(ups)) if ups else 0.0


def steps_to(curve: dict[int, float], threshold: float) -> int | None:
    """The first evaluation step whose held-out reward is at least ``threshold`` (None: never)."""
    return next((s for s in sorted(curve) if curve[s] >= threshold - 1e-12), None)
