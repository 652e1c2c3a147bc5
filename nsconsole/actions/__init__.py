"""The console's actions behind its keys: mixins of `nsconsole.app.ConsoleApp`, one per concern.

Each shares the App's state, as the trainer's mixins share `Trainer`'s (`engine/training/`): its
docstring names the App attributes it uses. `navigation` (the screens, the line the keys act on),
`key_switches` (which keys are on, and a toast saying why one is off), `key_lists` (`?` help and
the command palette), `steering` (stop, branch, rollback, tune: the requests a supervisor applies)
and `resume` (starting the supervisor of a line that none runs).
"""
