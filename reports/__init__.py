"""kvcanary reports: a run's journal turned into summary.json, evidence/, report.md,
junit.xml and report.html (`reports.render.render_run`), and the `kvcanary report` command.

Imports nothing heavy at package level: `reports.command` is loaded by the CLI dispatcher.
"""
