"""Experiments as data: an experiment file (``bench/experiments/NAME.toml``) names methods,
partitions, seeds, scale, overrides, budget, audit and claims; one resumable runner runs its
grid into one result schema; generic tables, claims and plots are made from the results.

- :mod:`.spec`: an experiment as frozen dataclasses, and its grid of cells; :mod:`.experiment_file` reads one;
- :mod:`.runner`: each cell as ``edgesplit local`` (and ``edgesplit audit``) in a subprocess;
- :mod:`.results`: the result schema, its validator, the figures a cell takes from its run;
- :mod:`.tables`: the long table, the summary over seeds, claims, markdown and plots;
- :mod:`.cli`: ``edgesplit bench run | check | table``.

Importing this package imports neither torch nor matplotlib.
"""

from .results import ResultsError, validate_results
from .experiment_file import load_experiment
from .spec import Experiment, ExperimentError

__all__ = ["Experiment", "ExperimentError", "ResultsError", "load_experiment", "validate_results"]
