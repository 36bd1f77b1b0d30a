"""The paper's experiments as commands (issue 7): ``evinfra experiment NAME [--quick]``.

See ``README.md``. Each experiment module has ``TITLE``, ``plans(config, scale, seed)`` (the
simulations to run, as :class:`~evinfra.experiments.runs.RunPlan` data) and
``report(runs, scale, config_path, seed)`` (tables and plots from their outcomes).
"""

from evinfra.experiments import (calibration, fig2a, fig2b, fig3, fig6, fig7, fig8, fig_d1,
                                 fig_d2, table_d1, table_d2, table_d4)
from evinfra.experiments import latency
from evinfra.experiments import fig5, table_d3, table_d5

EXPERIMENTS = {"calibration": calibration, "fig2a": fig2a, "fig2b": fig2b, "fig3": fig3,
               "fig6": fig6, "fig7": fig7, "fig8": fig8, "figD1": fig_d1, "figD2": fig_d2,
               "latency": latency, "tableD1": table_d1, "tableD2": table_d2, "tableD4": table_d4}
EXPERIMENTS.update(fig5=fig5, tableD3=table_d3, tableD5=table_d5)

__all__ = ["EXPERIMENTS"]
