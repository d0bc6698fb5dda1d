"""What a run leaves behind and reads back: run directory, records, report, tracking, plots, checkpoints, resume."""
