"""Line operations, one module per command: new, check, status, stop, branch, rollback, tune, bench."""
