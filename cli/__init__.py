"""The `synapse` command line: every subcommand, `doctor` and `demo`. Imports any package."""
