"""The console's screens: the lines screen, a line's screen and the dialogs."""
