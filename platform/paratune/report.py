"""Moved: the console tables live in paratune.tables (this name is kept for old imports)."""

# moved: see paratune.tables; kept until the layout pass
from paratune.tables import (  # noqa: F401
    cost_model_line,
    env_label,
    measured_compute,
    print_estimates,
    print_results,
    print_sweep,
    results_table,
    strategy_label,
    strategy_options,
)
