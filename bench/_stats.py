"""Mean ± sd over seeds, and the one rule by which two cells are said to differ.

No third-party imports: the results renderer uses it too.

A benchmark cell is one method on one setting, run once per seed. Its figures
are summarised as the mean and the sample standard deviation (n - 1 in the
denominator) over the seeds. Two cells *differ* only when their means are
further apart than their two standard deviations combined:
``|mean_a - mean_b| > sd_a + sd_b``. Anything closer is reported as no
measured difference at this number of seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

#: Stated wherever a difference is claimed (the results page quotes it).
DIFFERENCE_RULE = ("a difference is called a difference only when the means differ by more than the two standard "
                   "deviations combined (|mean A − mean B| > sd A + sd B); closer than that, the page says the cells do not differ")


def mean_sd(values: Iterable[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "n", "values"}`` over the values that are not None; sd is the sample
    standard deviation (n - 1), None below two values; mean None when there are none."""
    kept = [float(v) for v in values if v is not None]
    n = len(kept)
    mean = sum(kept) / n if n else None
    sd = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1)) if n >= 2 and mean is not None else None
    return {"mean": mean, "sd": sd, "n": n, "values": kept}


def differ(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool | None:
    """Whether two ``mean_sd`` summaries differ by the rule: |mean a - mean b| > sd a + sd b.
    None when either has no mean or no sd (fewer than two seeds): no claim either way."""
    if not a or not b or a.get("mean") is None or b.get("mean") is None or a.get("sd") is None or b.get("sd") is None:
        return None
    return abs(a["mean"] - b["mean"]) > a["sd"] + b["sd"]


def comparison(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any]:
    """a minus b: the difference of the means, the combined sd and the verdict of :func:`differ`."""
    ok = bool(a and b and a.get("mean") is not None and b.get("mean") is not None)
    diff = a["mean"] - b["mean"] if ok else None  # type: ignore[index]
    combined = a["sd"] + b["sd"] if ok and a.get("sd") is not None and b.get("sd") is not None else None  # type: ignore[index]
    return {"mean_difference": diff, "combined_sd": combined, "differ": differ(a, b)}
