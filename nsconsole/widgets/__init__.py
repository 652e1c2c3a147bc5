"""The console's widgets: one concept per module."""
