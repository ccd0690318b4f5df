"""Per-step profiling: records of every launched step (recorder.py, store.py), the cause of
every device idle gap (attribution.py), and the report (report.py: table, timeline picture,
Chrome trace)."""
