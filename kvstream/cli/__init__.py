"""The ``kvstream`` command line."""
