"""What crosses process boundaries: the supervisor's wire format (`wire`) and the typed facts that
the supervisor, the trainer, the CLI and the console share (`facts`)."""
