"""`localspec serve`: an OpenAI-compatible HTTP server over one engine. Knows nothing of rich or typer."""
