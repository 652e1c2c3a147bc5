"""The console's model of the lines it shows (imported through `nsconsole.state`): `view.py` (a
line fed by its supervisor or read from its files), `readings.py` (what the widgets read off it),
`line_health.py` (its health checks), `rows.py` (its rows, held compactly), `events.py` (its event
list), `forks.py` (the branches its supervisor holds), `run_facts.py` (what run.json says),
`book.py` (every line shown)."""
