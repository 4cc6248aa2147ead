"""The ``disagg`` command line."""
