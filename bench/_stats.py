"""Mean ± sd over seeds, and the one rule by which two cells are said to differ.

No third-party imports: the results renderer uses it too.

A benchmark cell is one method on one setting, run once per seed. Its figures
are summarised as the mean and the sample standard deviation (n - 1 in the
denominator) over the seeds. Two cells *differ* only when their means are
further apart than their two standard deviations combined:
``|mean_a - mean_b| > sd_a + sd_b``. Anything closer is reported as no
measured difference at this number of seeds.

Where both cells ran the same seeds and the seed draws what makes a setting hard
(the data subset and the Dirichlet split: one split is much harder than another
for every method), the seed-to-seed spread of each cell is mostly the splits'
and says little about the methods. There the comparison is *paired*: per seed,
A minus B; the cells differ only when the mean of those differences is further
from zero than their own standard deviation (``|mean d| > sd d``, at least two
seeds). The same figures are kept unpaired beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

#: Stated wherever a difference is claimed (the results page quotes it).
DIFFERENCE_RULE = ("a difference is called a difference only when the means differ by more than the two standard "
                   "deviations combined (|mean A − mean B| > sd A + sd B); closer than that, the page says the cells do not differ")


#: Stated wherever a paired difference is claimed.
PAIRED_RULE = ("paired over seeds (both cells ran the same seeds: the same data subsets, splits and draws): per seed, "
               "A minus B; a difference only when the mean of those differences is further from zero than their standard "
               "deviation (|mean d| > sd d, two seeds or more)")


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


def paired(a_by_seed: Mapping[Any, float | None], b_by_seed: Mapping[Any, float | None]) -> dict[str, Any]:
    """A minus B seed by seed, over the seeds both have a value for: the differences, their
    mean and sd, and whether they differ by :data:`PAIRED_RULE` (None below two seeds)."""
    seeds = sorted((s for s in a_by_seed if s in b_by_seed and a_by_seed[s] is not None and b_by_seed[s] is not None), key=str)
    differences = [float(a_by_seed[s]) - float(b_by_seed[s]) for s in seeds]  # type: ignore[arg-type]
    summary = mean_sd(differences)
    differ_ = None if summary["sd"] is None else abs(summary["mean"]) > summary["sd"]
    return {"seeds": seeds, "differences": differences, "mean_difference": summary["mean"], "sd_difference": summary["sd"],
            "n": summary["n"], "differ": differ_}
