"""Self-contained HTML reports of stored runs (`specscope report`, and the demo's report)."""

from specscope.report.build import build_report, load_runs, write_report

__all__ = ["build_report", "load_runs", "write_report"]
