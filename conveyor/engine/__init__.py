"""The engine loop: schedule, execute, commit."""
