"""The sweep: Ray Tune + Optuna over a space's valid plans, every trial in MLflow, a winner ready to use.

The package's modules, one job each:
    ledger     the record of finished trials and how a trial is scored (no Ray)
    stopping   when the calibrated search stops measuring (SweepStopRule)
    searchers  what to measure next: the candidate tree, the Optuna and calibrated searchers
    cluster    where trials run: the Tune trainable, the worker-group pool, node leases, pruning
    callbacks  Ray Tune's callbacks: each finished trial into the ledger and MLflow
    driver     run_sweep and the Tune run of its trials (SweepSettings)
    finish     re-measure, the winner by noise and loss parity, export, the last MLflow writes
    folder, figures, page   the sweep report (HTML) from the sweep folder alone (no Ray)

Import from the module that defines a name (`from paratune.sweep.ledger import Ledger`), or the
package's public API (`paratune.run_sweep`); importing `paratune.sweep` itself loads nothing, so
`paratune report`'s path (page, finish) never loads Ray Tune.
"""
