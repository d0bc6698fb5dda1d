"""``python -m fl_lightning.sweep``: Optuna sweeps whose trials are normal runs, chosen and pruned on validation only.

The parts, each one job:

- :mod:`.space`: the search space file (distributions, FLamby's ``10^(k/2)`` grid, fixed values);
- :mod:`.overrides`: a trial's values as ``train.py`` arguments (a callback's argument included);
- :mod:`.validate`: the refusals before any trial runs (keys, ranges, the objective), by the CLI's own parser;
- :mod:`.study`: the study in an RDB storage, its sampler and pruner, the plan every worker follows;
- :mod:`.owners` and :mod:`.claims`: who runs which trial, and which running trials are orphans to continue;
- :mod:`.trial_run`: one trial as a run directory, started, continued from its checkpoint, or read;
- :mod:`.pruning`: the callback that reports each validation round and stops a pruned trial;
- :mod:`.worker`: a worker process; :mod:`.threads`: its torch threads;
- :mod:`.results`: ``sweep_results.csv`` and the plots; :mod:`.best`: the best configuration's re-runs over seeds
  and their test comparison; :mod:`.cli`: the command.

Needs the ``sweep`` extra (``pip install -e .[sweep]``: Optuna).
"""
