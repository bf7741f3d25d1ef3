"""The ``tuner`` command line: ``app.py`` assembles it, one module per command."""
