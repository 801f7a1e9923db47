"""The `localspec` command line: thin typer commands that render what the library returns."""
