"""The command line's subcommands beside cli.py: models, spaces, profile, ui, compare, init."""
