"""The trainer: its loop, step engines, optimizer, schedules and validation."""
