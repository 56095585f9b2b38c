"""Moved: the sweep report is paratune.sweep.page (+ .figures, .folder); this name is kept for old imports."""

# moved: see paratune.sweep.page, paratune.sweep.figures and paratune.sweep.folder; kept until the layout pass
from paratune.sweep.figures import (  # noqa: F401
    DPI,
    FIGSIZE_IN,
    FIGURE_NAMES,
    FIGURE_PIXELS,
    MIN_IMPORTANCE_TRIALS,
    TOP_LOSS_PLANS,
    Figure,
    knob_importance,
    pareto_front,
    plot_importance,
    plot_losses,
    plot_predicted,
    plot_throughput_memory,
    plot_time_split,
    prediction_pairs,
)
from paratune.sweep.folder import Row, SweepFolder, entry_label, leaderboard, peak_bytes, read_sweep  # noqa: F401
from paratune.sweep.page import (  # noqa: F401
    HTML_NAME,
    REPORT_DIR,
    VERDICT_TEXT,
    SweepReportPage,
    build_report,
    report_files,
    write_sweep_report,
)
